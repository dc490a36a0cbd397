"""What the commands share: exit codes, the storage options, the run's identity from the
arguments, and reading a stored run with an error that names the option to check."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import ValidationError

from ft_train.config import DEFAULT_STORAGE_PATH, RunConfig, name_of
from ft_train.errors import StorageError
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


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
        raise argparse.ArgumentTypeError(f"{text!r}: the value after ':=' is not JSON ({e})") from e


def add_storage_args(p: argparse.ArgumentParser, default: str = DEFAULT_STORAGE_PATH) -> None:
    p.add_argument(
        "--storage-path",
        default=default,
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


def add_allow_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-train-loop-change",
        action="store_true",
        help="resume a run that exists with another training function or config than it last "
        "trained with (RunConfig.allow_train_loop_change); a finished run then trains on from "
        "its final checkpoint, e.g. with more epochs. Without it such a rerun is refused.",
    )


def run_config(args: argparse.Namespace, **extra: Any) -> RunConfig:
    return RunConfig(
        name=args.name,
        storage_path=args.storage_path,
        storage_options=dict(args.storage_options),
        **extra,
    )


def validation_message(e: ValidationError) -> str:
    return "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())


def load_state(run_config: RunConfig) -> RunState | None:
    try:
        storage = Storage(run_config.storage_path, run_config.storage_options)
        return RunStore(storage, name_of(run_config)).load()
    except StorageError:
        raise
    except Exception as e:  # fsspec backends raise their own types; say which setting to check
        raise StorageError(
            f"cannot read run {run_config.name!r} under {run_config.storage_path} "
            f"({type(e).__name__}: {e}); check --storage-path and --storage-option"
        ) from None
