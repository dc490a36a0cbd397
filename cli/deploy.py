"""`ft-train deploy`: every deployment in the current directory's prefect.yaml, and the recovery
automations of each (`cli/automations.py`), in one step, on the server PREFECT_API_URL names.

`prefect --no-prompt deploy --all` does the first half; the automations name each deployment's
id, so they are installed after it, and again whenever a deployment is re-created: running this
command again does both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from . import automations
from .common import EXIT_FAILED


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "deploy",
        help="deploy every deployment in prefect.yaml and install their recovery automations",
        description="Run `prefect --no-prompt deploy --all` in the current directory (the "
        "project's root, where prefect.yaml is), then `ft-train automations install` for every "
        "ft-train deployment, on the Prefect server that PREFECT_API_URL names.",
    )
    automations.add_within_arg(p)
    p.set_defaults(command_fn=run_deploy, command_parser=p, deployment=[])


def run_deploy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not os.path.exists("prefect.yaml"):
        parser.error(
            f"no prefect.yaml in {os.getcwd()}: run `ft-train deploy` from the project's root"
        )
    from prefect.settings import PREFECT_API_URL

    from .launch import prefect_reachable

    if not PREFECT_API_URL.value():
        parser.error("PREFECT_API_URL is not set: point it at your Prefect server's API")
    if not prefect_reachable():
        return EXIT_FAILED
    deployed = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"])
    if deployed.returncode != 0:
        print(f"error: `prefect deploy --all` exited {deployed.returncode}", file=sys.stderr)
        return EXIT_FAILED
    return automations.run_install(args, parser)
