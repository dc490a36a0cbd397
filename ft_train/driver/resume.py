"""May this driver start or resume the run, and with which config: `RunConfig.resume`.

    auto   resume the run if it exists, else start it (the default)
    never  start a new run: refuse a name that already has one
    must   resume the run: refuse if there is none, or if the training's config (`train_loop`,
           `train_loop_config`) differs from the one the run last trained with

A scheduled or automated rerun wants `must`: a misspelt name or storage path then fails instead
of training from scratch, and a deployment whose parameters were edited since the run started
does not go on with a model trained half under the old ones. `auto` resumes with a changed config
and logs each change. Changes to `scaling_config` and `checkpoint_config` are allowed in every
mode (a run may resume on fewer workers, or keep fewer checkpoints) and logged.

The run state records the config the run last trained with (`RunState.config`), so a refusal
names each changed field with its old and new value. A run stored before that record has only a
fingerprint: a change is seen, not which. `prepare_run` asks before it takes the run's lease, so
that a refusal writes nothing (not even the lease), and again under the lease, where it counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from ..config import CheckpointConfig, RunConfig, ScalingConfig
from ..errors import ConfigError
from ..storage.run_state import RunState, fingerprint

TRAINING = ("train_loop", "train_loop_config")  # what `must` refuses to see changed
SHOWN = 60  # characters of a value in a message


class Wanted(NamedTuple):
    """The config a driver would train with: as the run state records it, and its fingerprint."""

    doc: dict[str, Any]
    fingerprint: str


def wanted(
    train_loop: str | Callable,
    train_loop_config: dict[str, Any],
    scaling: ScalingConfig,
    checkpoints: CheckpointConfig,
) -> Wanted:
    doc = {
        "train_loop": _loop_name(train_loop),
        "train_loop_config": train_loop_config,
        "scaling_config": scaling.model_dump(mode="json"),
        "checkpoint_config": checkpoints.model_dump(mode="json"),
    }
    # As runs have always recorded it: before `RunState.config`, the only record of the config.
    fp = fingerprint(
        train_loop=train_loop
        if isinstance(train_loop, str)
        else getattr(train_loop, "__qualname__", ""),
        config=train_loop_config,
        scaling=scaling.model_dump(),
        checkpoints=checkpoints.model_dump(),
    )
    return Wanted(doc, fp)


def _loop_name(train_loop: str | Callable) -> str:
    if isinstance(train_loop, str):
        return train_loop
    return f"{getattr(train_loop, '__module__', '?')}:{getattr(train_loop, '__qualname__', '?')}"


def changes(old: Any, new: Any, path: str = "") -> list[str]:
    """Each difference between two JSON documents, as 'a.b: old -> new' (dicts field by field,
    anything else as a whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in [*old, *(k for k in new if k not in old)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in new:
                out.append(f"{where}: {_show(old[key])} -> (removed)")
            elif key not in old:
                out.append(f"{where}: (absent) -> {_show(new[key])}")
            else:
                out.extend(changes(old[key], new[key], where))
        return out
    return [] if old == new else [f"{path}: {_show(old)} -> {_show(new)}"]


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def check(
    run_config: RunConfig,
    state: RunState | None,
    new: Wanted,
    where: str,
    log: Callable[[str], None],
) -> None:
    """Raise ConfigError if `run_config.resume` refuses this start, given the run's stored state
    and the config this driver would train with; else log what changed."""
    policy, name = run_config.resume, run_config.name
    if state is None:
        if policy == "must":
            raise ConfigError(
                f"run_config.resume='must': there is no run {name!r} at {where} to resume; check "
                "run_config.name and run_config.storage_path, or set resume='auto' to start it"
            )
        return
    if policy == "never":
        raise ConfigError(
            f"run_config.resume='never': run {name!r} already exists at {where} ({state.status}, "
            f"{state.report_index} reports); use another run_config.name, or set resume='auto' "
            "to resume it"
        )
    if state.status == "finished":
        return  # nothing will be trained: the stored result is returned as it is
    training, other = _changed(state, new)
    if training and policy == "must":
        raise ConfigError(
            f"run_config.resume='must': the training's config differs from the one run {name!r} "
            f"last trained with: {'; '.join(training)}. Rerun with the stored values, or set "
            "resume='auto' to resume with the new ones"
        )
    if training:
        log(f"warning: run {name!r} resumes with a changed config: {'; '.join(training)}")
    if other:
        log(f"run {name!r} resumes with changed settings: {'; '.join(other)}")


def _changed(state: RunState, new: Wanted) -> tuple[list[str], list[str]]:
    """What differs from the config the run last trained with: (the training's, the rest)."""
    if state.config is None:  # stored before per-field records: only the fingerprint tells
        if state.config_fingerprint and state.config_fingerprint != new.fingerprint:
            return [
                "train_loop, train_loop_config, scaling_config or checkpoint_config (this "
                "run's state was stored by an ft-train that recorded no more than that)"
            ], []
        return [], []
    training: list[str] = []
    other: list[str] = []
    for key, value in new.doc.items():
        diff = changes(state.config.get(key), value, key)
        (training if key in TRAINING else other).extend(diff)
    return training, other
