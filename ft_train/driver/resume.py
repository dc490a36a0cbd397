"""May this driver start or resume the run, and with which config: `RunConfig.resume` and
`RunConfig.allow_train_loop_change`.

    auto   resume the run if it exists, else start it (the default)
    never  start a new run: refuse a name that already has one
    must   resume the run: refuse if there is none

Whatever the mode, a run that exists resumes only with the training's config (`train_loop`,
`train_loop_config`) it last trained with, unless `allow_train_loop_change` is set: a reused name
(a scheduled rerun, edited deployment parameters, a copied command) never goes on silently with a
model trained half under other settings. This holds for a finished run too; allowed, a finished
run trains on from its final checkpoint (training extended: more epochs), and an unchanged rerun
of it returns its result. `must` suits scheduled and automated reruns: a misspelt name or storage
path fails instead of training from scratch. Changes to `scaling_config` and `checkpoint_config`
are allowed in every mode (a run may resume on fewer workers, or keep fewer checkpoints) and
logged.

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
from ..wording import plural

TRAINING = ("train_loop", "train_loop_config")  # what is refused changed, unless allowed
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
) -> bool:
    """Raise ConfigError if the run's settings refuse this start, given the run's stored state
    and the config this driver would train with; else log what changed. True if a finished run
    is to train on (an allowed change), False otherwise."""
    policy, name = run_config.resume, run_config.name
    if state is None:
        if policy == "must":
            raise ConfigError(
                f"run_config.resume='must': there is no run {name!r} at {where} to resume; check "
                "run_config.name and run_config.storage_path, or set resume='auto' to start it"
            )
        return False
    if policy == "never":
        raise ConfigError(
            f"run_config.resume='never': run {name!r} already exists at {where} ({state.status}, "
            f"{plural(state.reports, 'report')}); use another run_config.name, or set resume='auto' "
            "to resume it"
        )
    training, other = _changed(state, new)
    finished = state.status == "finished"
    if training and not run_config.allow_train_loop_change:
        goes_on = "train it on from its final checkpoint" if finished else "resume it"
        raise ConfigError(
            f"run {name!r} at {where} ({state.status}) last trained with another train_loop or "
            f"train_loop_config: {'; '.join(training)}. Rerun with the stored values, use another "
            f"run_config.name for a new run, or set run_config.allow_train_loop_change=True to "
            f"{goes_on} with the new ones"
        )
    if finished and not training:
        return False  # nothing will be trained: the stored result is returned as it is
    if training:
        how = "trains on from its final checkpoint" if finished else "resumes"
        log(f"warning: run {name!r} {how} with a changed config: {'; '.join(training)}")
    if other:
        log(f"run {name!r} resumes with changed settings: {'; '.join(other)}")
    return finished


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
