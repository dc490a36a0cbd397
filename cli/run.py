"""`ft-train run MODULE:FUNCTION --name NAME --storage-path PATH --config KEY=VALUE`: any training
function, trained as the Prefect flow (Prefect's ephemeral mode unless PREFECT_API_URL names a
server), on a local Dask cluster or an existing one. The same command resumes the run: after a
crash, a kill of this process, or a failure that spent the budget.

`--config` values are JSON where they parse as JSON (epochs=2, lr=0.1, layers=[64,64],
debug=true), else strings (optimizer=adam); a dotted key sets a nested one (model.hidden=128).

MODULE is imported as `python -m` imports it: from the current directory first
(`import_from_cwd`), in this process and in every rank of a local cluster, restarted ones too.
A cluster elsewhere (--address) imports it from its workers' own path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from pydantic import ValidationError

from ft_train.config import CheckpointConfig, ClusterConfig, FailureConfig, ScalingConfig
from ft_train.errors import ConfigError
from ft_train.worker.rank import load_train_loop

from .common import EXIT_FAILED, add_allow_arg, add_storage_args, run_config, validation_message
from .launch import prefect_reachable, refused, stored_before, train_and_show
from .output import say


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "run",
        help="train MODULE:FUNCTION as the Prefect flow; the same command resumes the run",
        description="Train a function on every rank, as the ft-train Prefect flow on a Dask "
        "cluster. Running the same command again resumes the run from its latest checkpoint; "
        "a finished run is shown, not trained again.",
    )
    p.add_argument("train_loop", metavar="MODULE:FUNCTION", help="the training function")
    # Required, though a Python call may leave it out (a name generated per flow run): the same
    # command must resume the same run, and a generated name would start a new one every time.
    p.add_argument(
        "--name", required=True, help="the run's name: the same command, with it, resumes the run"
    )
    add_storage_args(p)
    p.add_argument(
        "--config",
        dest="config",
        metavar="KEY=VALUE",
        type=_config_item,
        action="append",
        default=[],
        help="one key of the function's config (JSON value, else a string); repeat for more",
    )
    p.add_argument("--workers", type=int, default=1, help="ranks (default: %(default)s)")
    p.add_argument("--gpu", action="store_true", help="one GPU per rank (NCCL)")
    p.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="restarts the run survives; -1 unlimited (default: %(default)s)",
    )
    p.add_argument("--num-to-keep", type=int, help="checkpoints to keep (default: all)")
    p.add_argument(
        "--resume",
        choices=["auto", "never", "must"],
        default="auto",
        help="a run of this name that exists: auto resumes it (or starts one), never refuses "
        "it, must refuses to start one (default: %(default)s)",
    )
    p.add_argument("--address", help="scheduler of an existing Dask cluster (default: a local one)")
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module every worker imports before a rank starts; repeat for more",
    )
    add_allow_arg(p)
    p.set_defaults(command_fn=run, command_parser=p)


def _config_item(text: str) -> tuple[list[str], Any]:
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. epochs=2)")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value  # not JSON: the string itself (optimizer=adam)
    return key.split("."), parsed


def train_loop_config(items: list[tuple[list[str], Any]]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for path, value in items:
        node = config
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return config


def flow_parameters(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flow's parameters from the options, or a usage error (exit 2) naming the bad one."""
    try:
        config = run_config(
            args,
            failure_config=FailureConfig(max_failures=args.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=args.num_to_keep),
            resume=args.resume,
            allow_train_loop_change=args.allow_train_loop_change,
        )
        scaling = ScalingConfig(num_workers=args.workers, use_gpu=args.gpu)
        cluster = ClusterConfig(address=args.address, preload=tuple(args.preload))
    except ValidationError as e:
        parser.error(validation_message(e))
    return {
        "train_loop": args.train_loop,
        "train_loop_config": train_loop_config(args.config),
        "scaling_config": scaling,
        "run_config": config,
        "cluster": cluster,
    }


def import_from_cwd() -> None:
    """Put the current directory first on the import path, as `python -m` does (the `ft-train`
    console script runs without it): in this process's `sys.path`, and in PYTHONPATH, which every
    process it starts inherits: the local cluster's fork server, its workers, the ranks that
    replace failed ones."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *paths])


def from_cwd(train_loop: str) -> str | None:
    """The file MODULE was imported from, where it lies under the current directory."""
    spec = importlib.util.find_spec(train_loop.partition(":")[0].partition(".")[0])
    origin = (
        None
        if spec is None
        else spec.origin or next(iter(spec.submodule_search_locations or []), None)
    )
    if origin is None:
        return None
    cwd = os.path.join(os.getcwd(), "")
    return origin if os.path.abspath(origin).startswith(cwd) else None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    params = flow_parameters(args, parser)
    import_from_cwd()
    try:
        load_train_loop(args.train_loop)  # here, not after Prefect's start: a usage error
    except ConfigError as e:
        parser.error(str(e))
    local = from_cwd(args.train_loop)
    if args.address is not None and local is not None:
        say(
            f"note: {args.train_loop.partition(':')[0]} is imported here from the current "
            f"directory ({local}); the workers of the Dask cluster at {args.address} import it "
            "from their own path: install it on every worker host, or put its directory on "
            "their PYTHONPATH (`dask worker --preload` it to import it once)"
        )
    if not prefect_reachable():
        return EXIT_FAILED
    may_start, before = stored_before(params["run_config"])
    if not may_start or refused(params, before):
        return EXIT_FAILED
    if before is None:
        say(f"ft-train run: new run {args.name!r} of {args.train_loop}, {args.workers} rank(s)")
    else:
        say(f"ft-train run: run {args.name!r} exists ({before.status}, step {before.report_index})")
    code, _ = train_and_show(params, before)
    return code
