"""The `ft-train` command line.

    ft-train demo     train the digits example as the Prefect flow, on a local Dask cluster,
                      in Prefect's ephemeral mode (no server to start); optionally crash a rank
                      once to show a restart from the latest checkpoint
    ft-train status   print a stored run (status, checkpoints, failures, metrics, the config
                      it last trained with, the driver that holds it); reads storage only
    ft-train list     one line per run under a storage path; reads storage only

The library never imports Prefect: `flows.train` is imported inside the demo command only, after
the environment defaults below are in place. Exit codes: 0 success, 1 a failed or missing run,
2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
from typing import Any, Optional, Sequence, TextIO

from pydantic import ValidationError

from .config import (
    DEFAULT_STORAGE_PATH,
    CheckpointConfig,
    ClusterConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
)
from .errors import FtTrainError, StorageError
from .lease import LEASE_FILE, LeaseDoc, holder_alive, live_holder, parse_lease, read_lease
from .result import TrainResult
from .run_state import INDEX_CHUNK, STATE_FILE, RunState, RunStore, now
from .storage import Storage

DEMO_TRAIN_LOOP = "ft_train.examples.digits:train_loop"
# What the demo's ranks import beyond torch (scikit-learn, for its data: 1.7 s on 2 cores), for
# `ClusterConfig.preload`: the fresh worker processes that replace a failed group's have it at once.
DEMO_PRELOAD = ("ft_train.examples.digits", "sklearn.datasets")
DEMO_BATCH_SIZE = 64  # the example's default; the crash step is checked against it
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# -- arguments ---------------------------------------------------------------------------------


def _storage_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE gives a string; KEY:=JSON a typed value (KEY:=false, KEY:='{"a": 1}')."""
    key, sep, value = text.partition("=")
    if not sep or not key or key == ":":
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (or KEY:=JSON)")
    if not key.endswith(":"):
        return key, value
    try:
        return key[:-1], json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: the value after ':=' is not JSON ({e})")


def _add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-path",
        default=DEFAULT_STORAGE_PATH,
        help="where runs live: a local directory or an fsspec URL such as s3://bucket/prefix "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--storage-option",
        dest="storage_options",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help="an fsspec option (endpoint_url=..., key=..., secret=...); KEY:=JSON for a typed "
        "value; repeat for more",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ft-train",
        description="Fault-tolerant distributed PyTorch training as a Prefect flow on Dask.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="train the digits example on a local Dask cluster (no Prefect server needed)",
        description="Train a small MLP on scikit-learn's digits with data-parallel ranks on a "
        "local Dask cluster, as the ft-train Prefect flow in ephemeral mode. Running it again "
        "with the same --name resumes an unfinished run, or shows a finished one.",
    )
    demo.add_argument("--name", default="demo", help="the run's name (default: %(default)s)")
    _add_storage_args(demo)
    demo.add_argument("--workers", type=int, default=2, help="ranks (default: %(default)s)")
    demo.add_argument("--epochs", type=int, default=4, help="epochs (default: %(default)s)")
    demo.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        help="steps between checkpoints (default: %(default)s)",
    )
    demo.add_argument(
        "--num-to-keep", type=int, default=2, help="checkpoints to keep (default: %(default)s)"
    )
    demo.add_argument(
        "--max-failures",
        type=int,
        default=1,
        help="restarts the run survives; -1 unlimited (default: %(default)s)",
    )
    demo.add_argument(
        "--crash-at-step",
        type=int,
        metavar="N",
        help="make one rank raise once, before training step N, to show a restart",
    )
    demo.add_argument(
        "--crash-rank", type=int, default=1, help="the rank that crashes (default: %(default)s)"
    )

    status = commands.add_parser(
        "status",
        help="show a stored run (reads storage only; no Prefect)",
        description="Print a stored run's status, checkpoints, failures and metrics.",
    )
    status.add_argument("name", help="the run's name")
    _add_storage_args(status)
    runs = commands.add_parser(
        "list",
        help="list the runs under a storage path (reads storage only; no Prefect)",
        description="One line per run: its status, reports and checkpoints so far, failures, "
        "last update, and the driver training it, if any.",
    )
    _add_storage_args(runs)
    # Each command reports its usage errors with its own usage line.
    demo.set_defaults(command_fn=run_demo, command_parser=demo)
    status.set_defaults(command_fn=show_status, command_parser=status)
    runs.set_defaults(command_fn=list_runs, command_parser=runs)
    return parser


def _run_config(args: argparse.Namespace, **extra: Any) -> RunConfig:
    return RunConfig(
        name=args.name,
        storage_path=args.storage_path,
        storage_options=dict(args.storage_options),
        **extra,
    )


def _validation_message(e: ValidationError) -> str:
    return "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())


# -- output ------------------------------------------------------------------------------------


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return "  ".join(f"{k}={fmt(v)}" for k, v in metrics.items())


def _headline(error: BaseException) -> str:
    """An error's first line. A TrainingFailedError goes on to list the failures, which the
    summary shows already."""
    return str(error).splitlines()[0].removesuffix(" Failures:")


def print_summary(result: TrainResult, out: TextIO = sys.stdout) -> None:
    """A run, as a person reads it: where it lives, how it ended, what it kept, what failed."""
    kept = len(result.best_checkpoints)
    w = lambda label, text: print(f"  {label:<12} {text}", file=out)  # noqa: E731
    w("path", result.path)
    w("status", result.status)
    w(
        "checkpoints",
        f"{kept} kept, latest {result.checkpoint.path}" if result.checkpoint else "none committed",
    )
    w("failures", str(len(result.failures)) if result.failures else "none")
    for f in result.failures:
        where = "".join(
            (
                f" on rank {f.rank}" if f.rank is not None else "",
                f" at step {f.step}" if f.step is not None else "",
            )
        )
        note = "" if f.charged else ", not charged to max_failures"
        print(f"    - {f.kind}{where}: {f.error} (attempt {f.attempt}{note})", file=out)
    w("metrics", _fmt_metrics(result.metrics) if result.metrics else "none reported")
    if result.error is not None:
        w("error", _headline(result.error))
    out.flush()


# -- demo --------------------------------------------------------------------------------------


class _DemoConsole(logging.Filter):
    """What the demo's console leaves out of the flow's logs; Prefect's API log handler, which
    sees each record before the console does, still stores all of it.

    - The traceback of ft-train's own errors. A group failure that Prefect retries, a spent
      failure budget, or bad input is an FtTrainError whose message says what happened; the
      rank's own traceback is logged by the controller, and the summary lists every failure.
      Their traceback would show only ft-train's and Prefect's internals. Any other exception
      keeps its traceback.
    - "Finished in state Completed()" of each task run: one per checkpoint, it would double the
      progress lines. Failed and crashed states, and the flow run's end, are kept.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FtTrainError):
            record.exc_info, record.exc_text = None, None
        if getattr(record, "task_run_id", None) is not None and isinstance(record.msg, str):
            return not record.msg.startswith("Finished in state Completed(")
        return True


def _quiet_console() -> None:
    # Prefect's console handler sits on the root logger; flow and task run records reach it last.
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DemoConsole())


def _demo_steps(workers: int, epochs: int) -> int:
    from .examples.digits import N_TRAIN

    per_rank = math.ceil(N_TRAIN / workers)  # DistributedSampler pads to an equal share
    return epochs * math.ceil(per_rank / DEMO_BATCH_SIZE)


def _fault_marker(run_config: RunConfig, rank: int, step: int) -> str:
    """Where the injected crash records that it fired, so a restart does not crash again.

    Keyed by (storage_path, name) and stable across invocations: the path is part of the
    training config, whose fingerprint a resume compares. Ranks run on this machine (the demo's
    cluster is local), so a local file is enough."""
    key = hashlib.sha256(f"{run_config.storage_path}\0{run_config.name}".encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"ft-train-demo-{uid}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, f"{key}-rank{rank}-step{step}.fired")


def _load_state(run_config: RunConfig) -> Optional[RunState]:
    try:
        storage = Storage(run_config.storage_path, run_config.storage_options)
        return RunStore(storage, run_config.name).load()
    except StorageError:
        raise
    except Exception as e:  # fsspec backends raise their own types; say which setting to check
        raise StorageError(
            f"cannot read run {run_config.name!r} under {run_config.storage_path} "
            f"({type(e).__name__}: {e}); check --storage-path and --storage-option"
        ) from None


def _say(text: str) -> None:
    print(text, flush=True)


def _check_demo_args(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The run's configs, or a usage error (exit 2) naming the option to change."""
    if args.epochs < 1 or args.checkpoint_every < 1:
        parser.error("--epochs and --checkpoint-every must be at least 1")
    try:
        run_config = _run_config(
            args,
            failure_config=FailureConfig(max_failures=args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=args.num_to_keep),
        )
        scaling = ScalingConfig(num_workers=args.workers)
    except ValidationError as e:
        parser.error(_validation_message(e))
    if args.crash_at_step is not None:
        if not 0 <= args.crash_rank < args.workers:
            parser.error(f"--crash-rank {args.crash_rank} must be between 0 and --workers - 1")
        total = _demo_steps(args.workers, args.epochs)
        if not 0 <= args.crash_at_step < total:
            parser.error(
                f"--crash-at-step {args.crash_at_step}: {args.workers} ranks train "
                f"{args.epochs} epoch(s) in {total} steps; pick a step from 0 to {total - 1}"
            )
    return run_config, scaling


def _demo_config(
    args: argparse.Namespace, run_config: RunConfig, before: Optional[RunState]
) -> tuple[dict[str, Any], Optional[str]]:
    """The training function's config, and the crash's marker file when one is injected."""
    config: dict[str, Any] = {"epochs": args.epochs, "checkpoint_every": args.checkpoint_every}
    if args.crash_at_step is None:
        return config, None
    marker = _fault_marker(run_config, args.crash_rank, args.crash_at_step)
    if before is None and os.path.exists(marker):
        os.remove(marker)  # left by an earlier run of this name whose storage was deleted
    config["faults"] = [
        {"rank": args.crash_rank, "step": args.crash_at_step, "kind": "raise", "marker": marker}
    ]
    return config, marker


def _announce(args: argparse.Namespace, before: Optional[RunState], crash: bool) -> None:
    crashing = ""
    if crash:
        crashing = f"; rank {args.crash_rank} will crash once before step {args.crash_at_step}"
    if before is None:
        _say(
            f"ft-train demo: run {args.name!r}, an MLP on the digits data set, {args.workers} "
            f"ranks, {args.epochs} epoch(s), max_failures={args.max_failures}{crashing}"
        )
    elif before.status == "finished":
        _say(f"ft-train demo: run {args.name!r} exists and has finished; the flow returns it")
    else:
        _say(f"ft-train demo: resuming run {args.name!r} ({before.status}){crashing}")


def run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    run_config, scaling = _check_demo_args(args, parser)
    try:
        before = _load_state(run_config)
        storage = Storage(run_config.storage_path, run_config.storage_options)
        lease = live_holder(storage, run_config.name) if before is not None else None
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    if lease is not None:  # say so now, not after Prefect's start
        print(
            f"error: run {args.name!r} is being trained by another driver ({lease.describe()}); "
            "wait for it to end or stop it, or use another --name",
            file=sys.stderr,
        )
        return EXIT_FAILED
    config, marker = _demo_config(args, run_config, before)
    _announce(args, before, crash=marker is not None)

    # Before Prefect is imported: an offline machine must not print telemetry errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.train import train  # imports Prefect and sets up its logging

    _quiet_console()
    try:
        result = train(
            train_loop=DEMO_TRAIN_LOOP,
            train_loop_config=config,
            scaling_config=scaling,
            run_config=run_config,
            cluster=ClusterConfig(preload=DEMO_PRELOAD),
        )
    except KeyboardInterrupt:
        _say(f"\ninterrupted; run the same command again to resume {args.name!r}")
        return EXIT_INTERRUPTED
    except FtTrainError as e:
        return _report_failure(args, run_config, e)

    if before is not None and before.status == "finished":
        _say(f"\nRun {args.name!r} had already finished: nothing was trained. The stored run:")
    else:
        _say(f"\nRun {args.name!r} {result.status}.")
    print_summary(result)
    if marker is not None and result.status == "finished" and os.path.exists(marker):
        os.remove(marker)  # the run is over: nothing will read it again
    return EXIT_OK if result.status == "finished" else EXIT_FAILED


def _report_failure(args: argparse.Namespace, run_config: RunConfig, error: FtTrainError) -> int:
    """The flow raised one of ft-train's own errors: show the stored run (if any) and the error,
    without a traceback (the error says what to change; a rank's traceback was logged above)."""
    try:
        state = _load_state(run_config)
    except StorageError as read_error:  # the run's own error, printed below, matters more
        print(f"(the stored run cannot be read: {read_error})", file=sys.stderr)
        state = None
    if state is None:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    _say(f"\nRun {args.name!r} {state.status}.")
    storage = Storage(run_config.storage_path, run_config.storage_options)
    print_summary(TrainResult.from_state(storage, state, run_config.checkpoint_config))
    # The summary lists the failures: the error's first line is enough here.
    print(f"error: {type(error).__name__}: {_headline(error)}", file=sys.stderr, flush=True)
    if state.status == "failed":
        _say(
            "Run the same command again to resume it, from its latest checkpoint if any, with a "
            "fresh failure budget; or raise --max-failures."
        )
    return EXIT_FAILED


# -- status ------------------------------------------------------------------------------------


def show_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        run_config = _run_config(args)
    except ValidationError as e:
        parser.error(_validation_message(e))
    try:
        state = _load_state(run_config)
        if state is None:
            raise StorageError(f"no run named {args.name!r} under {run_config.storage_path}")
        storage = Storage(run_config.storage_path, run_config.storage_options)
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
        print(f"error: cannot list runs under {args.storage_path} ({type(e).__name__}: {e}); "
              "check --storage-path and --storage-option", file=sys.stderr)
        return EXIT_FAILED
    rows = []
    for name in names:
        head = found.get(f"{name}/{STATE_FILE}")
        if head is None:
            continue  # not a run (or one whose first driver wrote nothing yet)
        try:
            state = RunStore(storage, name).parse(head)  # as a rerun would read it
        except StorageError:
            rows.append((name, "unreadable", "", "", "", "", f"`ft-train status {name}` says why"))
            continue
        raw_lease = found.get(f"{name}/{LEASE_FILE}")
        lease = None if raw_lease is None else parse_lease(raw_lease)
        kept = state.sealed_chunks * INDEX_CHUNK + len(state.checkpoints)
        rows.append((
            name, state.status, str(state.report_index), str(kept), str(len(state.failures)),
            f"{state.updated_at:%Y-%m-%d %H:%M:%S}",
            "" if lease is None or lease.released else f"pid {lease.pid} on {lease.host}: "
            + _driver_verdict(lease),
        ))
    if not rows:
        print(f"no runs under {storage.url}")
        return EXIT_OK
    header = ("NAME", "STATUS", "REPORTS", "CHECKPOINTS", "FAILURES", "UPDATED (UTC)", "DRIVER")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print(("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]).rstrip())
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.command_fn(args, args.command_parser)
    except BrokenPipeError:  # `ft-train list | head`: the reader has what it wanted
        # Python's own advice: point stdout at /dev/null, or the flush at exit fails again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
