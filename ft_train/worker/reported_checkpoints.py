"""`ft_train.get_all_reported_checkpoints()`: the run's committed checkpoints, as a rank sees them
(Ray's `ray.train.get_all_reported_checkpoints`, which returns `ReportedCheckpoint`s).

The run state on storage is what counts as committed (`storage.run_state`): the rank reads it,
with the sealed index chunks of a long run, and lists every checkpoint it references, oldest
first, each with the metrics of its round (rank 0's). That includes the checkpoints of earlier
attempts and earlier driver runs, and this attempt's once committed; not those retention has
dropped (`CheckpointConfig.num_to_keep`), as Ray's list does not.

What it waits for: Ray blocks until the controller has processed every report() this worker
made. ft-train's driver processes a round only once every rank reported it, and tells the ranks
nothing back, so a rank waits (polling the run state) until every checkpoint it attached itself
in this attempt is committed. A round in which only other ranks attached files is listed once
committed: call it on a rank that attaches files (e.g. rank 0) to wait for each round. Both of
Ray's consistency modes wait for the same thing (ft-train validates nothing), and every
checkpoint's status is COMMITTED. With `timeout_s`, the list returned when it runs out holds
what is committed then (Ray's behaviour too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import SessionError
from ..report_config import CheckpointConsistencyMode
from ..storage.checkpoint import Checkpoint
from ..storage.fs import Storage
from ..storage.run_state import RunState, RunStore

POLL_MIN_S, POLL_MAX_S = 0.01, 0.5  # the run state is read this often while waiting


class ReportedCheckpointStatus(Enum):
    """Ray's `ray.train.ReportedCheckpointStatus`. ft-train runs no validation: always COMMITTED."""

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"


@dataclass
class ReportedCheckpoint:
    """A committed checkpoint and the metrics of its round (Ray's `ray.train.ReportedCheckpoint`)."""

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED


def check_mode(consistency_mode: Any, timeout_s: Any) -> None:
    if not isinstance(consistency_mode, CheckpointConsistencyMode):
        raise SessionError(
            f"get_all_reported_checkpoints(consistency_mode={consistency_mode!r}): pass "
            "CheckpointConsistencyMode.COMMITTED or CheckpointConsistencyMode.VALIDATED (the "
            "same in ft-train, which validates nothing)"
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0
    ):
        raise SessionError(
            f"get_all_reported_checkpoints(timeout_s={timeout_s!r}): pass seconds (>= 0), or "
            "None to wait until this rank's checkpoints are committed"
        )


def all_reported(
    storage: Storage, name: str, until_index: int, timeout_s: float | None
) -> list[ReportedCheckpoint]:
    """The run's committed checkpoints, once the run state covers report `until_index` (0: at
    once), or once `timeout_s` has passed."""
    store = RunStore(storage, name)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = POLL_MIN_S
    while True:
        state = store.load()
        if until_index <= 0 or (state is not None and state.report_index >= until_index):
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        # A bounded poll of the run state: the driver writes it at each commit, and tells the
        # ranks nothing back (report() never waits for the driver).
        wait = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
        time.sleep(wait)
        delay = min(2 * delay, POLL_MAX_S)
    return [] if state is None else listed(storage, store, state)


def listed(storage: Storage, store: RunStore, state: RunState) -> list[ReportedCheckpoint]:
    return [
        ReportedCheckpoint(
            Checkpoint(storage.uri(f"{store.name}/{e.dir_name}"), storage.options), e.metrics
        )
        for e in store.all_checkpoints(state)
    ]
