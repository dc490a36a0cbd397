"""The failure policy: given a failure and the run's history, RETRY or RAISE, and the error a
RAISE ends the run with.

It decides only; the controller executes the decision (and Prefect's task retry carries it out).
"""

from __future__ import annotations

import enum

from .. import knobs
from ..config import FailureConfig
from ..errors import RankError, TrainingFailedError, WorkerGroupError
from ..storage.run_state import FailureKind, FailureRecord, RunState
from ..wording import after_report, plural


class Decision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


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
    if start_failures >= knobs.START_FAILURE_LIMIT:
        return Decision.RAISE
    if failure.kind is FailureKind.PREEMPTION:
        if max_preemption_failures == -1:
            return Decision.RETRY
        return Decision.RETRY if preemptions(state) <= max_preemption_failures else Decision.RAISE
    if not failure.charged or max_failures == -1:
        return Decision.RETRY
    return Decision.RETRY if state.charged_failures <= max_failures else Decision.RAISE


def final_error(
    failure: FailureRecord, state: RunState, config: FailureConfig, start_failures: int
) -> TrainingFailedError:
    """Why the run ends, after `decide` said RAISE: the budget it exceeded and the failures
    that spent it (those since the budget was last reset)."""
    recent = state.failures[state.budget_start :]
    if start_failures >= knobs.START_FAILURE_LIMIT:
        return TrainingFailedError(
            f"training failed: the worker group failed to start {start_failures} "
            "times in a row (before every rank had joined the process group); a restart "
            "will not fix this: check that the workers can reach each other (firewall, "
            f"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) and their logs. Failures:\n"
            f"{describe(recent[-start_failures:])}",
            [f.model_dump(mode="json") for f in recent],
        )
    if failure.kind is FailureKind.PREEMPTION:
        count, listed = preemptions(state), [f for f in recent if f.kind is FailureKind.PREEMPTION]
        budget = f"max_preemption_failures={config.max_preemption_failures}"
    else:
        count, listed = state.charged_failures, [f for f in recent if f.charged]
        budget = f"max_failures={config.max_failures}"
    message = (
        f"training failed: {plural(count, 'failure')} {'exceeds' if count == 1 else 'exceed'} "
        f"{budget} "
        f"(run_config.failure_config.{budget.split('=')[0]}). "
        f"Failures:\n{describe(listed)}"
    )
    recorded = [f.model_dump(mode="json") for f in recent]
    if failure.kind is FailureKind.PREEMPTION:
        return TrainingFailedError(message, recorded)
    return WorkerGroupError(message, worker_failures(state.failures, failure.attempt), recorded)


def worker_failures(failures: list[FailureRecord], attempt: int) -> dict[int, RankError]:
    """Ray's `WorkerGroupError.worker_failures`: the charged failures of the attempt `attempt`
    (the last one, whose failure spent the budget), by rank, each rebuilt as a RankError.
    ft-train blames one rank per attempt, so this holds that rank's."""
    return {
        f.rank: RankError(f.error, f.traceback, f.rank, f.step, f.kind)
        for f in failures
        if f.attempt == attempt and f.charged and f.rank is not None
    }


def preemptions(state: RunState) -> int:
    return sum(f.kind is FailureKind.PREEMPTION for f in state.failures[state.budget_start :])


def retries_left(state: RunState, max_failures: int) -> int:
    """How many more charged failures the run survives; a large number for unlimited."""
    if max_failures == -1:
        return 1_000_000
    return max(0, max_failures - state.charged_failures)


def describe(failures: list[FailureRecord]) -> str:
    return "\n".join(
        f"  {i}. {f.kind} on rank {f.rank} {after_report(f.step)} (attempt {f.attempt}, "
        f"{f.time:%Y-%m-%d %H:%M:%S}Z): {f.error}"
        for i, f in enumerate(failures, 1)
    )


def driver_restarts_spent(state: RunState, config: FailureConfig) -> TrainingFailedError | None:
    """After a driver crash is recorded: the error that fails the run when the driver crashes
    since the budget was last reset (a rerun of a failed run resets it) exceed
    `max_driver_restarts`; else None. Counted from the run state, not from what Prefect
    remembers of its flow runs, so that no rerun loop outlives it."""
    crashes = [
        f for f in state.failures[state.budget_start :] if f.kind is FailureKind.DRIVER_CRASH
    ]
    budget = config.max_driver_restarts
    if budget == -1 or len(crashes) <= budget:
        return None
    return TrainingFailedError(
        f"training failed: its driver crashed {plural(len(crashes), 'time')}, more than "
        f"max_driver_restarts={budget} (run_config.failure_config.max_driver_restarts); "
        "something kills the driver (its flow process) every time: look at its machine and "
        "logs, then rerun the run by hand (that counts afresh), or raise the setting. "
        "Driver crashes:\n"
        + "\n".join(
            f"  {i}. {after_report(f.step)} ({f.time:%Y-%m-%d %H:%M:%S}Z): {f.error}"
            for i, f in enumerate(crashes, 1)
        ),
        [f.model_dump(mode="json") for f in state.failures[state.budget_start :]],
    )
