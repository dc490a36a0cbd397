"""The `ft-train` command line's entry point: the parser, and the dispatch to a command.

    ft-train run      train MODULE:FUNCTION as the Prefect flow; the same command resumes
                      the run (`cli/run.py`)
    ft-train demo     train the digits example as the Prefect flow, on a local Dask cluster,
                      in Prefect's ephemeral mode (no server to start); a rank crashes once
                      partway, to show the recovery and its cost (`cli/demo.py`)
    ft-train status   print a stored run (status, checkpoints, failures, metrics, the config
                      it last trained with, the driver that holds it); reads storage only
    ft-train list     a table of the runs under a storage path; reads storage only
                      (`cli/runs.py`); both with --json for scripts
    ft-train automations install
                      the Prefect automations that rerun a crashed driver (`cli/automations.py`)
    ft-train deploy   every deployment in prefect.yaml and their automations, in one step
                      (`cli/deploy.py`)
    ft-train dask-config
                      the Dask settings, as YAML, for a cluster that ft-train does not start

Exit codes: 0 success, 1 a failed or missing run, 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from . import automations, dask_config, demo, deploy, run, runs
from .common import EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ft-train",
        description="Fault-tolerant distributed PyTorch training as a Prefect flow on Dask.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_parser(commands)
    demo.add_parser(commands)
    runs.add_parsers(commands)
    automations.add_parser(commands)
    deploy.add_parser(commands)
    dask_config.add_parser(commands)
    return parser


def _version() -> str:
    try:
        return version("ft-train")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # Each command reports its usage errors with its own usage line.
        return args.command_fn(args, args.command_parser)
    except BrokenPipeError:  # `ft-train list | head`: the reader has what it wanted
        # Python's own advice: point stdout at /dev/null, or the flush at exit fails again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
