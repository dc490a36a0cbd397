"""`ft-train demo`: the demo deployment's parameters (`deployments/demo.py`), trained as the
Prefect flow in ephemeral mode on a local Dask cluster; optionally a rank crashes once, to show
a restart from the latest checkpoint.

The options' defaults are the demo's parameters; each option replaces one of them. `flows.train`
(and with it Prefect) is imported when the command runs, after the environment defaults are set.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import sys
import tempfile
from typing import Any

from pydantic import ValidationError

from deployments import demo
from ft_train.config import CheckpointConfig, ClusterConfig, FailureConfig, RunConfig, ScalingConfig
from ft_train.driver.lease import live_holder
from ft_train.errors import FtTrainError, StorageError
from ft_train.result import TrainResult
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState

from .common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_storage_args,
    load_state,
    run_config,
    validation_message,
)
from .output import headline, print_summary, say

DEMO_BATCH_SIZE = 64  # the example's default; the crash step is checked against it


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `demo` command; its defaults are `deployments.demo`'s parameters."""
    p = commands.add_parser(
        "demo",
        help="train the digits example on a local Dask cluster (no Prefect server needed)",
        description="Train a small MLP on scikit-learn's digits with data-parallel ranks on a "
        "local Dask cluster, as the ft-train Prefect flow in ephemeral mode. Running it again "
        "with the same --name resumes an unfinished run, or shows a finished one.",
    )
    run, loop = demo.RUN_CONFIG, demo.TRAIN_LOOP_CONFIG
    p.add_argument("--name", default=run["name"], help="the run's name (default: %(default)s)")
    add_storage_args(p, default=run["storage_path"])
    p.add_argument(
        "--workers",
        type=int,
        default=demo.SCALING_CONFIG["num_workers"],
        help="ranks (default: %(default)s)",
    )
    p.add_argument(
        "--epochs", type=int, default=loop["epochs"], help="epochs (default: %(default)s)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=loop["checkpoint_every"],
        help="steps between checkpoints (default: %(default)s)",
    )
    p.add_argument(
        "--num-to-keep",
        type=int,
        default=run["checkpoint_config"]["num_to_keep"],
        help="checkpoints to keep (default: %(default)s)",
    )
    p.add_argument(
        "--max-failures",
        type=int,
        default=run["failure_config"]["max_failures"],
        help="restarts the run survives; -1 unlimited (default: %(default)s)",
    )
    p.add_argument(
        "--crash-at-step",
        type=int,
        metavar="N",
        help="make one rank raise once, before training step N, to show a restart",
    )
    p.add_argument(
        "--crash-rank", type=int, default=1, help="the rank that crashes (default: %(default)s)"
    )
    p.set_defaults(command_fn=run_demo, command_parser=p)


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
    from ft_train.examples.digits import N_TRAIN

    per_rank = math.ceil(N_TRAIN / workers)  # DistributedSampler pads to an equal share
    return epochs * math.ceil(per_rank / DEMO_BATCH_SIZE)


def _fault_marker(config: RunConfig, rank: int, step: int) -> str:
    """Where the injected crash records that it fired, so a restart does not crash again.

    Keyed by (storage_path, name) and stable across invocations: the path is part of the
    training config, whose fingerprint a resume compares. Ranks run on this machine (the demo's
    cluster is local), so a local file is enough."""
    key = hashlib.sha256(f"{config.storage_path}\0{config.name}".encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"ft-train-demo-{uid}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, f"{key}-rank{rank}-step{step}.fired")


def _check_demo_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[RunConfig, ScalingConfig]:
    """The run's configs, or a usage error (exit 2) naming the option to change."""
    if args.epochs < 1 or args.checkpoint_every < 1:
        parser.error("--epochs and --checkpoint-every must be at least 1")
    try:
        config = run_config(
            args,
            failure_config=FailureConfig(max_failures=args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=args.num_to_keep),
        )
        scaling = ScalingConfig.model_validate({**demo.SCALING_CONFIG, "num_workers": args.workers})
    except ValidationError as e:
        parser.error(validation_message(e))
    if args.crash_at_step is not None:
        if not 0 <= args.crash_rank < args.workers:
            parser.error(f"--crash-rank {args.crash_rank} must be between 0 and --workers - 1")
        total = _demo_steps(args.workers, args.epochs)
        if not 0 <= args.crash_at_step < total:
            parser.error(
                f"--crash-at-step {args.crash_at_step}: {args.workers} ranks train "
                f"{args.epochs} epoch(s) in {total} steps; pick a step from 0 to {total - 1}"
            )
    return config, scaling


def flow_parameters(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flow's parameters: the demo's (`deployments.demo`), with each option's value in place
    of the one it names; or a usage error (exit 2). No crash injected yet (`_inject_crash`)."""
    config, scaling = _check_demo_args(args, parser)
    loop_config = {
        **demo.TRAIN_LOOP_CONFIG,
        "epochs": args.epochs,
        "checkpoint_every": args.checkpoint_every,
    }
    return {
        "train_loop": demo.TRAIN_LOOP,
        "train_loop_config": loop_config,
        "scaling_config": scaling,
        "run_config": config,
        "cluster": ClusterConfig.model_validate(demo.CLUSTER),
    }


def _inject_crash(
    args: argparse.Namespace, params: dict[str, Any], before: RunState | None
) -> str | None:
    """Add --crash-at-step's fault to the training config; its marker file, if one is injected."""
    if args.crash_at_step is None:
        return None
    marker = _fault_marker(params["run_config"], args.crash_rank, args.crash_at_step)
    if before is None and os.path.exists(marker):
        os.remove(marker)  # left by an earlier run of this name whose storage was deleted
    params["train_loop_config"]["faults"] = [
        {"rank": args.crash_rank, "step": args.crash_at_step, "kind": "raise", "marker": marker}
    ]
    return marker


def _announce(args: argparse.Namespace, before: RunState | None, crash: bool) -> None:
    crashing = ""
    if crash:
        crashing = f"; rank {args.crash_rank} will crash once before step {args.crash_at_step}"
    if before is None:
        say(
            f"ft-train demo: run {args.name!r}, an MLP on the digits data set, {args.workers} "
            f"ranks, {args.epochs} epoch(s), max_failures={args.max_failures}{crashing}"
        )
    elif before.status == "finished":
        say(f"ft-train demo: run {args.name!r} exists and has finished; the flow returns it")
    else:
        say(f"ft-train demo: resuming run {args.name!r} ({before.status}){crashing}")


def _stored_before(args: argparse.Namespace, config: RunConfig) -> tuple[bool, RunState | None]:
    """(whether the demo may start, the run as stored before it). Prints why it may not: the
    storage cannot be read, or another driver holds the run (said now, not after Prefect's start)."""
    try:
        before = load_state(config)
        storage = Storage(config.storage_path, config.storage_options)
        lease = live_holder(storage, config.name) if before is not None else None
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return False, None
    if lease is not None:
        print(
            f"error: run {args.name!r} is being trained by another driver ({lease.describe()}); "
            "wait for it to end or stop it, or use another --name",
            file=sys.stderr,
        )
        return False, None
    return True, before


def run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    params = flow_parameters(args, parser)
    config = params["run_config"]
    may_start, before = _stored_before(args, config)
    if not may_start:
        return EXIT_FAILED
    marker = _inject_crash(args, params, before)
    _announce(args, before, crash=marker is not None)

    # Before Prefect is imported: an offline machine must not print telemetry errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.train import train  # imports Prefect and sets up its logging

    _quiet_console()
    try:
        result = train(**params)
    except KeyboardInterrupt:
        say(f"\ninterrupted; run the same command again to resume {args.name!r}")
        return EXIT_INTERRUPTED
    except FtTrainError as e:
        return _report_failure(args, config, e)

    if before is not None and before.status == "finished":
        say(f"\nRun {args.name!r} had already finished: nothing was trained. The stored run:")
    else:
        say(f"\nRun {args.name!r} {result.status}.")
    print_summary(result)
    if marker is not None and result.status == "finished" and os.path.exists(marker):
        os.remove(marker)  # the run is over: nothing will read it again
    return EXIT_OK if result.status == "finished" else EXIT_FAILED


def _report_failure(args: argparse.Namespace, config: RunConfig, error: FtTrainError) -> int:
    """The flow raised one of ft-train's own errors: show the stored run (if any) and the error,
    without a traceback (the error says what to change; a rank's traceback was logged above)."""
    try:
        state = load_state(config)
    except StorageError as read_error:  # the run's own error, printed below, matters more
        print(f"(the stored run cannot be read: {read_error})", file=sys.stderr)
        state = None
    if state is None:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    say(f"\nRun {args.name!r} {state.status}.")
    storage = Storage(config.storage_path, config.storage_options)
    print_summary(TrainResult.from_state(storage, state, config.checkpoint_config))
    # The summary lists the failures: the error's first line is enough here.
    print(f"error: {type(error).__name__}: {headline(error)}", file=sys.stderr, flush=True)
    if state.status == "failed":
        say(
            "Run the same command again to resume it, from its latest checkpoint if any, with a "
            "fresh failure budget; or raise --max-failures."
        )
    return EXIT_FAILED
