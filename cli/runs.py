"""`ft-train status` and `ft-train list`: stored runs, read from storage alone (no Prefect).

`status` prints one run: status, checkpoints, failures, metrics, the config it last trained with,
and the driver that holds it. `list` prints one line per run under a storage path.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from ft_train.driver.lease import LEASE_FILE, LeaseDoc, holder_alive, parse_lease, read_lease
from ft_train.errors import StorageError
from ft_train.result import TrainResult
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import INDEX_CHUNK, STATE_FILE, RunStore, now

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    add_storage_args,
    load_state,
    run_config,
    validation_message,
)
from .output import print_summary

HEADER = ("NAME", "STATUS", "REPORTS", "CHECKPOINTS", "FAILURES", "UPDATED (UTC)", "DRIVER")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """The `status` and `list` commands, each reporting its usage errors with its own usage."""
    status = commands.add_parser(
        "status",
        help="show a stored run (reads storage only; no Prefect)",
        description="Print a stored run's status, checkpoints, failures and metrics.",
    )
    status.add_argument("name", help="the run's name")
    add_storage_args(status)
    runs = commands.add_parser(
        "list",
        help="list the runs under a storage path (reads storage only; no Prefect)",
        description="One line per run: its status, reports and checkpoints so far, failures, "
        "last update, and the driver training it, if any.",
    )
    add_storage_args(runs)
    status.set_defaults(command_fn=show_status, command_parser=status)
    runs.set_defaults(command_fn=list_runs, command_parser=runs)


def show_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = run_config(args)
    except ValidationError as e:
        parser.error(validation_message(e))
    try:
        state = load_state(config)
        if state is None:
            raise StorageError(f"no run named {args.name!r} under {config.storage_path}")
        storage = Storage(config.storage_path, config.storage_options)
        result = TrainResult.from_state(storage, state)
        lease = read_lease(storage, args.name)
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"Run {args.name!r}")
    print_summary(result)
    if state.config is not None:  # runs stored before it was recorded have none
        print(f"  {'train_loop':<12} {state.config['train_loop']}")
        print(f"  {'config':<12} {json.dumps(state.config['train_loop_config'], sort_keys=True)}")
    if lease is not None and not lease.released:
        print(f"  {'driver':<12} {lease.describe()}: {_driver_verdict(lease)}")
    return EXIT_OK


def _driver_verdict(lease: LeaseDoc) -> str:
    return {
        True: "training it now",
        False: "gone without an end (killed); the next flow run resumes",
        None: f"on another machine; renewed {(now() - lease.renewed_at).total_seconds():.0f}s ago",
    }[holder_alive(lease)]


def list_runs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """One line per run under --storage-path: two reads a run (its state's head, its lease),
    all at once (fsspec fetches many files concurrently from object stores)."""
    try:
        storage = Storage(args.storage_path, dict(args.storage_options))
        names = storage.list_dir("")
        found = storage.read_many([f"{n}/{f}" for n in names for f in (STATE_FILE, LEASE_FILE)])
    except Exception as e:  # fsspec backends raise their own types; say which setting to check
        print(
            f"error: cannot list runs under {args.storage_path} ({type(e).__name__}: {e}); "
            "check --storage-path and --storage-option",
            file=sys.stderr,
        )
        return EXIT_FAILED
    rows = [row for name in names if (row := _row(storage, name, found)) is not None]
    if not rows:
        print(f"no runs under {storage.url}")
        return EXIT_OK
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER) - 1)]
    for row in [HEADER, *rows]:
        print(("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]).rstrip())
    return EXIT_OK


def _row(storage: Storage, name: str, found: dict[str, bytes]) -> tuple[str, ...] | None:
    """Run `name`'s line of `ft-train list`, from the files read for it; None if not a run."""
    head = found.get(f"{name}/{STATE_FILE}")
    if head is None:
        return None  # not a run (or one whose first driver wrote nothing yet)
    try:
        state = RunStore(storage, name).parse(head)  # as a rerun would read it
    except StorageError:
        return (name, "unreadable", "", "", "", "", f"`ft-train status {name}` says why")
    raw_lease = found.get(f"{name}/{LEASE_FILE}")
    lease = None if raw_lease is None else parse_lease(raw_lease)
    kept = state.sealed_chunks * INDEX_CHUNK + len(state.checkpoints)
    return (
        name,
        state.status,
        str(state.report_index),
        str(kept),
        str(len(state.failures)),
        f"{state.updated_at:%Y-%m-%d %H:%M:%S}",
        ""
        if lease is None or lease.released
        else f"pid {lease.pid} on {lease.host}: " + _driver_verdict(lease),
    )
