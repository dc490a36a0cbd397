"""`ft-train demo`: the demo deployment's parameters (`deployments/demo.py`), trained as the
Prefect flow in ephemeral mode on a local Dask cluster. What ft-train is for, by default: a rank
crashes once partway, the group restarts from the latest checkpoint, and the summary says what
the recovery cost. `--no-faults` trains without the crash. The crash reaches the ranks through
their environment, not the run's config: the run is the demo deployment's, and a rerun of either
finds the other's finished run.

The options' defaults are the demo's parameters; each option replaces one of them. `flows.train`
(and with it Prefect) is imported when the command runs, after the environment defaults are set.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import tempfile
from typing import Any

from pydantic import ValidationError

from deployments import demo
from ft_train.config import CheckpointConfig, ClusterConfig, FailureConfig, RunConfig, ScalingConfig
from ft_train.storage.run_state import RunState
from ft_train.testing.faults import FAULTS_ENV

from .common import EXIT_FAILED, add_allow_arg, add_storage_args, run_config, validation_message
from .launch import prefect_reachable, refused, stored_before, train_and_show
from .output import say

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
        help="the step before which one rank raises, once (default: partway, just after a "
        "checkpoint's step, so that the restart trains a few steps again)",
    )
    p.add_argument(
        "--crash-rank",
        type=int,
        help="the rank that crashes (default: the last one)",
    )
    p.add_argument("--no-faults", action="store_true", help="train without the crash: a clean run")
    add_allow_arg(p)
    p.set_defaults(command_fn=run_demo, command_parser=p)


def _demo_steps(workers: int, epochs: int) -> int:
    from ft_train.examples.digits import N_TRAIN

    per_rank = math.ceil(N_TRAIN / workers)  # DistributedSampler pads to an equal share
    return epochs * math.ceil(per_rank / DEMO_BATCH_SIZE)


def _fault_marker(config: RunConfig, rank: int, step: int) -> str:
    """Where the injected crash records that it fired, so a restart does not crash again.

    Keyed by (storage_path, name) and stable across invocations: every driver of the run finds
    it. Ranks run on this machine (the demo's cluster is local), so a local file is enough."""
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
            allow_train_loop_change=args.allow_train_loop_change,
        )
        scaling = ScalingConfig.model_validate({**demo.SCALING_CONFIG, "num_workers": args.workers})
    except ValidationError as e:
        parser.error(validation_message(e))
    if args.no_faults and (args.crash_at_step is not None or args.crash_rank is not None):
        parser.error("--no-faults trains without a crash: leave out --crash-at-step/--crash-rank")
    if args.crash_rank is not None and not 0 <= args.crash_rank < args.workers:
        parser.error(f"--crash-rank {args.crash_rank} must be between 0 and --workers - 1")
    total = _demo_steps(args.workers, args.epochs)
    if args.crash_at_step is not None and not 0 <= args.crash_at_step < total:
        parser.error(
            f"--crash-at-step {args.crash_at_step}: {args.workers} ranks train "
            f"{args.epochs} epoch(s) in {total} steps; pick a step from 0 to {total - 1}"
        )
    return config, scaling


def _crash_point(args: argparse.Namespace) -> tuple[int, int]:
    """(rank, step) of the demo's crash: the options', else the last rank, partway through the
    run, a couple of steps after a checkpoint (the restart trains those again: what it costs)."""
    rank = args.workers - 1 if args.crash_rank is None else args.crash_rank
    if args.crash_at_step is not None:
        return rank, args.crash_at_step
    total, every = _demo_steps(args.workers, args.epochs), args.checkpoint_every
    step = (total // 2) // every * every + max(1, every // 2)
    return rank, min(step, total - 1)


def flow_parameters(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flow's parameters: the demo's (`deployments.demo`), with each option's value in place
    of the one it names; or a usage error (exit 2). The crash is not among them (`_inject_crash`)."""
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
) -> dict[str, Any] | None:
    """The demo's crash (`_crash_point`), or None: not for `--no-faults`, nor for a run that has
    finished (it trains nothing), nor once it has fired for this run (its marker exists).

    Not part of `train_loop_config`: the ranks read it from their environment
    (`ft_train.testing.faults.FAULTS_ENV`, set by `run_demo`), so the run's stored config is the
    demo deployment's own and either one's rerun finds the other's finished run. It stays a real
    fault: the rank raises, impolitely, at that step."""
    if args.no_faults or (before is not None and before.status == "finished"):
        return None
    rank, step = _crash_point(args)
    marker = _fault_marker(params["run_config"], rank, step)
    if before is None and os.path.exists(marker):
        os.remove(marker)  # left by an earlier run of this name whose storage was deleted
    if os.path.exists(marker):
        return None  # fired in an earlier driver of this run: the restart passes it by
    return {"rank": rank, "step": step, "kind": "raise", "marker": marker}


def _announce(
    args: argparse.Namespace, fault: dict[str, Any] | None, before: RunState | None
) -> None:
    crashing = (
        ""
        if fault is None
        else (f"; rank {fault['rank']} will crash once before step {fault['step']}")
    )
    if before is None:
        say(
            f"ft-train demo: run {args.name!r}, an MLP on the digits data set, {args.workers} "
            f"ranks, {args.epochs} epoch(s), max_failures={args.max_failures}{crashing}"
        )
    elif before.status == "finished":
        say(f"ft-train demo: run {args.name!r} exists and has finished")
    else:
        say(f"ft-train demo: resuming run {args.name!r} ({before.status}){crashing}")


def run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    params = flow_parameters(args, parser)
    if not prefect_reachable():
        return EXIT_FAILED
    may_start, before = stored_before(params["run_config"])
    if not may_start:
        return EXIT_FAILED
    if refused(params, before):
        return EXIT_FAILED
    fault = _inject_crash(args, params, before)
    _announce(args, fault, before)
    if fault is not None:  # before Prefect and the cluster start: the ranks inherit it
        os.environ[FAULTS_ENV] = json.dumps([fault])
    code, result = train_and_show(params, before, _demo_steps(args.workers, args.epochs))
    if fault is not None and result is not None and result.status == "finished":
        with contextlib.suppress(FileNotFoundError):  # never fired: a resume began past it
            os.remove(fault["marker"])  # the run is over: nothing will read it again
    return code
