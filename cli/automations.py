"""`ft-train automations install`: automatic driver recovery for the ft-train deployments on a
Prefect server (`deployments/automations.py` says what the two automations do)."""

from __future__ import annotations

import argparse
from datetime import timedelta

from .common import EXIT_FAILED, EXIT_OK


def add_parser(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser(
        "automations",
        help="install the Prefect automations that rerun a crashed driver",
        description="Prefect automations for ft-train deployments, on the server that "
        "PREFECT_API_URL names.",
    )
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    install = actions.add_parser(
        "install",
        help="rerun crashed drivers, and mark drivers whose heartbeats stopped Crashed",
        description="Create (or replace) two automations per deployment: one reruns a flow run "
        "that crashed, with the same parameters (it resumes by name); one marks a flow run "
        "Crashed when its heartbeats stop (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, 30 s in "
        "prefect.yaml).",
    )
    install.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="FLOW/NAME",
        help="a deployment, e.g. ft-train/demo (repeatable; default: every ft-train deployment)",
    )
    add_within_arg(install)
    install.set_defaults(command_fn=run_install, command_parser=install)


def add_within_arg(p: argparse.ArgumentParser) -> None:
    """--within, the zombie automation's silence; `ft-train deploy` takes it too."""
    p.add_argument(
        "--within",
        type=float,
        default=90.0,
        metavar="SECONDS",
        help="a flow run with no event this long after a heartbeat is marked Crashed: 3 "
        "heartbeats or more (default: %(default)g)",
    )


def run_install(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from prefect.settings import PREFECT_API_URL

    from deployments.automations import install

    from .launch import prefect_reachable

    if not PREFECT_API_URL.value():
        parser.error("PREFECT_API_URL is not set: point it at your Prefect server's API")
    if not prefect_reachable():
        return EXIT_FAILED
    try:
        names = install(args.deployment, timedelta(seconds=args.within))
    except ValueError as e:
        parser.error(str(e))
    if not names:
        print("no ft-train deployment found: run `prefect deploy` first")
        return EXIT_FAILED
    print("\n".join(f"installed {n}" for n in names))
    return EXIT_OK
