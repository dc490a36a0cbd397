"""The controller: runs worker-group attempts until the next committed checkpoint.

One call of `run_segment()` is one stretch of training between two checkpoints (one Prefect task
run). A group failure stops every rank, is recorded in the run state, and is judged by the failure
policy: RETRY raises `WorkerGroupError` (the caller retries `run_segment`, which restarts the
group from the latest committed checkpoint); RAISE raises `TrainingFailedError`.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from distributed import KilledWorker

from .. import failure_policy
from ..checkpoint_manager import CheckpointManager
from ..config import FailureConfig
from ..errors import RankFailure, SessionError, TrainingFailedError, WorkerGroupError
from ..failure_policy import Decision
from ..run_state import AttemptRecord, FailureRecord, RunState, RunStore
from ..worker_group import GroupPlan, WorkerGroup
from .rounds import ReportRounds, Round
from .state import Errored, Finished, Idle, Running

logger = logging.getLogger("ft_train")

# How long the other ranks of a failed group get to fail on their own before their processes
# are killed. gloo notices a dead peer at once; NCCL may not, and a CUDA context is not to be
# trusted after a failure, so GPU ranks are always killed.
STOP_GRACE_S = 3.0
# After every rank returned, wait this long for their last reports still in flight.
REPORT_DRAIN_TIMEOUT_S = 30.0


@dataclass
class Segment:
    kind: Literal["checkpoint", "finished"]
    report_index: int
    metrics: dict[str, Any]
    checkpoint: Optional[str] = None


class Controller:
    def __init__(
        self,
        client,
        plan: GroupPlan,
        state: RunState,
        store: RunStore,
        manager: CheckpointManager,
        failure_config: FailureConfig,
        log: Callable[[str], None] = logger.info,
    ):
        self.client, self.plan, self.state = client, plan, state
        self.store, self.manager, self.failure_config = store, manager, failure_config
        self.log = log
        self.phase: Idle | Running | Finished | Errored = Idle()
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.rounds = ReportRounds(plan.num_workers, state.report_index)
        self.done: dict[int, dict] = {}
        self.last_metrics: dict[str, Any] = {}
        self.dead_workers: set[str] = set()
        self._last_progress_log = time.monotonic()

    # -- public -------------------------------------------------------------------------------

    def retries_left(self) -> int:
        return failure_policy.retries_left(self.state, self.failure_config.max_failures)

    def run_segment(self) -> Segment:
        """Train until the next committed checkpoint or the end of training."""
        if isinstance(self.phase, Errored):
            raise self.phase.error
        if isinstance(self.phase, Finished):
            return Segment("finished", self.state.report_index, self.last_metrics)
        if isinstance(self.phase, Idle):
            self._start_group()
        while True:
            segment = self._drain_rounds()
            if segment is not None:
                return segment
            if len(self.done) == self.plan.num_workers:
                return self._finish()
            segment = self._handle(self.events.get())
            if segment is not None:
                return segment

    def abort(self, error: BaseException) -> None:
        """The driver is going away (Ctrl+C, SIGTERM, an unexpected error): record why, so the
        next flow run with the same name resumes, then stop the ranks."""
        if not self.phase.is_terminal:
            if isinstance(error, Exception):
                self.state.status, self.state.error = "failed", f"{type(error).__name__}: {error}"
            else:  # KeyboardInterrupt, SystemExit, Prefect's TerminationSignal: not charged
                self.state.status = "interrupted"
                self.state.failures.append(
                    FailureRecord(
                        kind="driver_interrupt",
                        error=type(error).__name__,
                        attempt=self._attempt(),
                        step=self.rounds.last_index,
                        charged=False,
                    )
                )
            # Crash ordering: the record first, so a driver killed while stopping still leaves it.
            self.store.save(self.state)
        if isinstance(self.phase, Running):
            try:
                self.phase.group.stop(grace_s=0.0)
            except Exception as e:  # the driver is leaving anyway; a local cluster dies with it
                self.log(f"could not stop every rank ({type(e).__name__}: {e})")
        if not self.phase.is_terminal:
            self.phase = Errored(TrainingFailedError(self.state.error or "interrupted"))

    # -- transitions --------------------------------------------------------------------------

    def _attempt(self) -> int:
        return len(self.state.attempts) - 1

    def _start_group(self) -> None:
        attempt = len(self.state.attempts)
        group = WorkerGroup(self.client, attempt, self.events)
        self.rounds = ReportRounds(self.plan.num_workers, self.state.report_index)
        self.done = {}
        group.start(self.plan, self.state.latest, self.state.report_index, self.dead_workers)
        self.state.attempts.append(
            AttemptRecord(
                attempt=attempt,
                attempt_id=group.attempt_id,
                world_size=len(group.addresses),
                restored_from=self.state.latest,
                start_report_index=self.state.report_index,
            )
        )
        self.state.status = "running"
        self.store.save(self.state)
        where = f"checkpoint {self.state.latest}" if self.state.latest else "scratch"
        self.log(f"attempt {attempt}: {len(group.addresses)} ranks started from {where}")
        self.phase = Running(group)

    def _handle(self, event: tuple) -> Optional[Segment]:
        kind, attempt = event[0], event[1]
        if not isinstance(self.phase, Running) or attempt != self.phase.group.attempt:
            return None  # a late event from a group already stopped
        if kind == "report":
            self.rounds.add(event[2])
            return None
        if kind == "worker_lost":
            group = self.phase.group
            kind = group.lost_kind(event[2])
            what = "process died" if kind == "process_death" else "node left the cluster"
            self._fail(group.addresses.index(event[2]), kind, f"worker {event[2]}: {what}")
        if kind == "rank_done":
            return self._rank_done(event[2], event[3])
        return None

    def _rank_done(self, rank: int, future) -> Optional[Segment]:
        if future.status == "finished":
            self.done[rank] = future.result()
            return None
        if future.status == "cancelled":
            self._fail(rank, "node_loss", "the rank's Dask task was cancelled")
        exc = future.exception()
        if isinstance(exc, RankFailure):
            self.log(f"rank {rank} raised at step {exc.step}:\n{exc.traceback}")
            self._fail(rank, "exception", exc.error, step=exc.step)
        if isinstance(exc, KilledWorker):
            self._fail(rank, "process_death", "the rank's worker process died")
        self._fail(rank, "process_death", f"{type(exc).__name__}: {exc}")

    def _drain_rounds(self) -> Optional[Segment]:
        while (rnd := self.rounds.pop_complete()) is not None:
            segment = self._complete_round(rnd)
            if segment is not None:
                return segment
        return None

    def _complete_round(self, rnd: Round) -> Optional[Segment]:
        self.last_metrics = rnd.metrics
        if rnd.dir_name is None:
            if time.monotonic() - self._last_progress_log > 10:
                self._last_progress_log = time.monotonic()
                self.log(f"step {rnd.index}: {_fmt(rnd.metrics)}")
            return None
        dropped = self.manager.commit(
            self.state, rnd.dir_name, rnd.index, rnd.metrics, rnd.files, self._attempt()
        )
        self.log(
            f"checkpoint {rnd.dir_name} committed at step {rnd.index}: {_fmt(rnd.metrics)}"
            + (f" (deleted {len(dropped)} older)" if dropped else "")
        )
        return Segment("checkpoint", rnd.index, rnd.metrics, rnd.dir_name)

    def _finish(self) -> Segment:
        """Every rank returned: wait for reports still in flight, then mark the run finished."""
        counts = {r: d["reports"] for r, d in sorted(self.done.items())}
        if len(set(counts.values())) > 1:
            raise SessionError(
                f"ranks called report() a different number of times ({counts}); every rank must "
                "call report() the same number of times"
            )
        expected = counts[0]
        deadline = time.monotonic() + REPORT_DRAIN_TIMEOUT_S
        while self.rounds.last_index < expected and time.monotonic() < deadline:
            if (segment := self._drain_rounds()) is not None:
                return segment  # the next call finishes
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if event[0] == "report":
                self.rounds.add(event[2])
        if self.rounds.last_index < expected:
            lost = f"reports {self.rounds.last_index + 1}..{expected} never reached the driver"
            self._fail(0, "exception", lost, step=self.rounds.last_index)
        self.phase.group.release()
        self.state.status = "finished"
        self.state.final_metrics = self.last_metrics
        self.store.save(self.state)
        self.manager.collect_orphans(self.state)
        self.phase = Finished()
        self.log(f"training finished after {self.rounds.last_index} steps: {_fmt(self.last_metrics)}")
        return Segment("finished", self.rounds.last_index, self.last_metrics)

    def _fail(self, rank: int, kind: str, error: str, step: Optional[int] = None) -> None:
        """Stop the group, record the failure, and raise what the failure policy decided."""
        group = self.phase.group
        grace = 0.0 if self.plan.use_gpu else STOP_GRACE_S
        failed = group.addresses[rank] if kind == "exception" else None
        self.dead_workers |= group.stop(grace_s=grace, failed=failed)
        failure = FailureRecord(
            kind=kind,
            rank=rank,
            step=step if step is not None else self.rounds.received.get(rank, self.rounds.last_index),
            error=error,
            attempt=group.attempt,
        )
        self.state.failures.append(failure)
        max_failures = self.failure_config.max_failures
        decision = failure_policy.decide(failure, self.state, max_failures)
        charged = self.state.failures[self.state.budget_start :]
        if decision is Decision.RAISE:
            listing = failure_policy.describe([f for f in charged if f.charged])
            error = TrainingFailedError(
                f"training failed: {self.state.charged_failures} failures exceed "
                f"max_failures={max_failures} (run_config.failure_config.max_failures). "
                f"Failures:\n{listing}",
                [f.model_dump(mode="json") for f in charged],
            )
            self.state.status, self.state.error = "failed", str(error)
            self.store.save(self.state)
            self.phase = Errored(error)
            raise error
        self.store.save(self.state)
        self.phase = Idle(after_failure=failure)
        budget = "unlimited" if max_failures == -1 else f"{self.state.charged_failures} of {max_failures}"
        raise WorkerGroupError(
            f"rank {rank} failed ({kind}) at step {failure.step}: {error}. Restarting from "
            f"{self.state.latest or 'scratch'} (failure {budget} allowed by max_failures)",
            failure.model_dump(mode="json"),
        )


def _fmt(metrics: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(metrics.items())[:6]
    )
