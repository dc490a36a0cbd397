"""The failure policy: given a failure and the run's history, RETRY or RAISE.

It decides only; the controller executes the decision (and Prefect's task retry carries it out).
"""

from __future__ import annotations

import enum

from .run_state import FailureRecord, RunState


class Decision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


# A worker group that fails this many times in a row before all of its ranks have joined the
# process group (rendezvous errors, workers dying at start) ends the run, whatever max_failures
# says: a restart cannot fix it, and with max_failures=-1 it would loop for ever.
START_FAILURE_LIMIT = 3


def decide(
    failure: FailureRecord,
    state: RunState,
    max_failures: int,
    max_preemption_failures: int = -1,
    start_failures: int = 0,
) -> Decision:
    """`state.failures` already holds `failure`; `start_failures` counts the groups in a row,
    this one included, that failed before every rank had started. A preemption is judged by
    its own budget; other uncharged failures (driver events) never RAISE."""
    if start_failures >= START_FAILURE_LIMIT:
        return Decision.RAISE
    if failure.kind == "preemption":
        if max_preemption_failures == -1:
            return Decision.RETRY
        return Decision.RETRY if preemptions(state) <= max_preemption_failures else Decision.RAISE
    if not failure.charged or max_failures == -1:
        return Decision.RETRY
    return Decision.RETRY if state.charged_failures <= max_failures else Decision.RAISE


def preemptions(state: RunState) -> int:
    return sum(f.kind == "preemption" for f in state.failures[state.budget_start :])


def retries_left(state: RunState, max_failures: int) -> int:
    """How many more charged failures the run survives; a large number for unlimited."""
    if max_failures == -1:
        return 1_000_000
    return max(0, max_failures - state.charged_failures)


def describe(failures: list[FailureRecord]) -> str:
    return "\n".join(
        f"  {i}. {f.kind} on rank {f.rank} at step {f.step} (attempt {f.attempt}, "
        f"{f.time:%Y-%m-%d %H:%M:%S}Z): {f.error}"
        for i, f in enumerate(failures, 1)
    )
