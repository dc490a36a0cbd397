"""`ft-train status` and `ft-train list`: stored runs, read from storage alone (no Prefect).

`status` prints one run: status, checkpoints, failures, what each recovery cost, metrics, the
config it last trained with, and the driver that holds it. `list` prints a table, one row per
run under a storage path. With `--json` both print one JSON document for scripts instead: every
retained checkpoint (path, report, metrics), every failure, what each recovery cost (reports
lost, the gap), the final metrics. Progress is counted in reports (DESIGN.md's vocabulary): the
`REPORTS` column and `"reports"` are `RunState.reports`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ft_train.driver.lease import LEASE_FILE, LeaseDoc, holder_alive, parse_lease, read_lease
from ft_train.errors import StorageError
from ft_train.result import TrainResult
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import (
    INDEX_CHUNK,
    STATE_FILE,
    CheckpointEntry,
    RunState,
    RunStore,
    now,
)

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    add_storage_args,
    load_state,
    run_config,
    validation_message,
)
from .output import print_recoveries, print_summary, recovery_costs

HEADER = ("NAME", "STATUS", "REPORTS", "CHECKPOINTS", "FAILURES", "UPDATED (UTC)", "DRIVER")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """The `status` and `list` commands, each reporting its usage errors with its own usage."""
    status = commands.add_parser(
        "status",
        help="show a stored run (reads storage only; no Prefect)",
        description="Print a stored run's status, checkpoints, failures and metrics.",
    )
    status.add_argument("name", help="the run's name")
    runs = commands.add_parser(
        "list",
        help="list the runs under a storage path (reads storage only; no Prefect)",
        description="One row per run: its status, reports and checkpoints so far, failures, "
        "last update, and the driver training it, if any.",
    )
    for p in (status, runs):
        add_storage_args(p)
        p.add_argument("--json", action="store_true", help="one JSON document, for scripts")
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
        entries = RunStore(storage, args.name).all_checkpoints(state) if args.json else []
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    if lease is not None and lease.released:
        lease = None
    if args.json:
        doc = _run_doc(storage, state, entries, lease)
        costs = [r.doc() for r in recovery_costs(state)]
        print(json.dumps({**doc, "recoveries": costs}, indent=2))
        return EXIT_OK
    print(f"Run {args.name!r}")
    print_summary(result)
    print_recoveries(state)
    if state.config is not None:  # runs stored before it was recorded have none
        print(f"  {'train_loop':<12} {state.config['train_loop']}")
        print(f"  {'config':<12} {json.dumps(state.config['train_loop_config'], sort_keys=True)}")
    if lease is not None:
        print(f"  {'driver':<12} {lease.describe()}: {_driver_verdict(lease)}")
    return EXIT_OK


def _run_doc(
    storage: Storage, state: RunState, entries: list[CheckpointEntry], lease: LeaseDoc | None
) -> dict[str, Any]:
    """A run as `--json` prints it. `entries`: the checkpoints to list (`list` reads the
    state's head only: its newest, up to 128)."""
    return {
        "name": state.name,
        "path": storage.uri(state.name),
        "status": state.status,
        "reports": state.reports,  # the run's progress; `step` of a checkpoint is its report
        "checkpoints_kept": state.sealed_chunks * INDEX_CHUNK + len(state.checkpoints),
        "latest_checkpoint": storage.uri(f"{state.name}/{state.latest}") if state.latest else None,
        "checkpoints": [
            {
                "path": storage.uri(f"{state.name}/{e.dir_name}"),
                "report": e.report_index,
                "step": e.report_index,  # the same number, under its old name
                "metrics": e.metrics,
                "committed_at": e.committed_at.isoformat(),
            }
            for e in entries
        ],
        "failures": [f.model_dump(mode="json") for f in state.failures],
        "metrics": state.metrics,
        "final_metrics": state.final_metrics,
        "error": state.error,
        "config": state.config,
        "attempts": len(state.attempts),
        "driver_runs": state.driver_runs,
        "created_at": state.created_at.isoformat(),
        "updated_at": state.updated_at.isoformat(),
        "driver": None
        if lease is None
        else {"pid": lease.pid, "host": lease.host, "state": _driver_verdict(lease)},
    }


def _driver_verdict(lease: LeaseDoc) -> str:
    return {
        True: "training it now",
        False: "gone without an end (killed); the next flow run resumes",
        None: f"on another machine; renewed {(now() - lease.renewed_at).total_seconds():.0f}s ago",
    }[holder_alive(lease)]


def list_runs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """One row per run under --storage-path: two reads a run (its state's head, its lease),
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
    docs = [doc for name in names if (doc := _read_run(storage, name, found)) is not None]
    if args.json:
        print(json.dumps(docs, indent=2))
    elif not docs:
        print(f"no runs under {storage.url}")
    else:
        _print_table(docs)
    return EXIT_OK


def _read_run(storage: Storage, name: str, found: dict[str, bytes]) -> dict[str, Any] | None:
    """Run `name` as `list` shows it, from the files read for it; None if not a run."""
    head = found.get(f"{name}/{STATE_FILE}")
    if head is None:
        return None  # not a run (or one whose first driver wrote nothing yet)
    try:
        state = RunStore(storage, name).parse(head)  # as a rerun would read it
    except StorageError as e:
        return {"name": name, "status": "unreadable", "error": str(e)}
    raw_lease = found.get(f"{name}/{LEASE_FILE}")
    lease = None if raw_lease is None else parse_lease(raw_lease)
    if lease is not None and lease.released:
        lease = None
    return _run_doc(storage, state, state.checkpoints, lease)


def _print_table(docs: list[dict[str, Any]]) -> None:
    table = Table(*HEADER, box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for d in docs:
        if d["status"] == "unreadable":
            table.add_row(
                d["name"], "unreadable", "", "", "", "", f"`ft-train status {d['name']}` says why"
            )
            continue
        driver = d["driver"]
        table.add_row(
            d["name"],
            d["status"],
            str(d["reports"]),
            str(d["checkpoints_kept"]),
            str(len(d["failures"])),
            d["updated_at"][:19].replace("T", " "),
            "" if driver is None else f"pid {driver['pid']} on {driver['host']}: {driver['state']}",
        )
    console = Console()
    if not console.is_terminal:  # a pipe or a file: whole rows, as wide as they are
        console = Console(width=4096)
    console.print(table)
