"""The controller: a state machine over worker-group attempts (`state.py` draws it).

`step()` makes one transition; `_set_state` is the one place a transition takes effect. In a
group's states the watch (`group_events.GroupWatch`) says what its events and deadlines mean,
and the controller carries out what it says (`_carry_out`): only the controller stops groups,
commits, records failures and asks the failure policy. Every reading of the time and every wait
goes through its clock (`clock.Clock`), so that a test can give it one of its own.

`run_segment()` steps until the next committed checkpoint (one Prefect task run), the end of
training, or a failure the caller retries: a charged failure raises `AttemptFailed` (Prefect's
task retry calls `run_segment` again, which restarts the group from the latest committed
checkpoint); an uncharged one (a preemption, a damaged checkpoint dropped) restarts at once. A
failure the policy does not retry raises the run's final error (`WorkerGroupError` once
max_failures is spent on worker failures). Decisions come from `ft_train.policy`; the cluster is
behind `ports.Cluster`, so a test drives the controller with fakes.

One piece: the controller carries out every transition of the run (starting a group, committing
a round, stopping a group and recording its failure, draining, finishing), and each needs the
run state, the store, the checkpoint manager and the callbacks together; split by transition,
the pieces would share all of that state again.
"""

from __future__ import annotations

import logging
import pickle
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from .. import knobs
from ..config import FailureConfig
from ..errors import (
    AttemptFailed,
    FtTrainError,
    RankFailure,
    RunLockedError,
    SessionError,
    TrainingFailedError,
)
from ..policy import failure as failure_policy
from ..protocol import GroupEvent, LeaseLost, Report, Reported
from ..snapshots.rounds import SnapshotRound, SnapshotTier
from ..storage.checkpoint_manager import CheckpointManager
from ..storage.run_state import (
    AttemptRecord,
    FailureKind,
    FailureRecord,
    RunState,
    RunStore,
    now,
)
from ..wording import after_report, plural
from ..worker.journal import Reached, reached
from ..worker.warm import TORCH
from .callbacks import Callback, notify
from .clock import Clock, SystemClock
from .group_events import (
    Ended,
    GroupFailed,
    GroupUp,
    GroupWatch,
    Outcome,
    Preempted,
    Resized,
    RestoreFailed,
    Returned,
    RoundComplete,
)
from .ports import Cluster, GroupPlan
from .rounds import ReportRounds, Round, collision_warning, label_conflict
from .state import (
    Attempt,
    Draining,
    Errored,
    Finished,
    GroupState,
    Preempting,
    Resizing,
    Restarting,
    Running,
    State,
)

logger = logging.getLogger("ft_train")


@dataclass
class Segment:
    kind: Literal["checkpoint", "finished"]
    report_index: int
    metrics: dict[str, Any]
    checkpoint: str | None = None


class Controller:
    def __init__(
        self,
        cluster: Cluster,
        plan: GroupPlan,
        state: RunState,
        store: RunStore,
        manager: CheckpointManager,
        failure_config: FailureConfig,
        log: Callable[[str], None] = logger.info,
        callbacks: Sequence[Callback] = (),
        clock: Clock | None = None,
    ):
        self.cluster, self.plan, self.state = cluster, plan, state
        self.store, self.manager, self.failure_config = store, manager, failure_config
        self.log, self.callbacks = log, list(callbacks)
        self.clock: Clock = clock or SystemClock()
        # What a user should look into (a rank's traceback, say): a warning, unless the caller
        # gives a logger of its own.
        self.warn: Callable[[str], None] = logger.warning
        self.current: State = Restarting()
        self.events: queue.Queue[GroupEvent] = queue.Queue()
        self.last_metrics: dict[str, Any] = {}
        # What the training function returned on rank 0, once every rank returned (Ray's
        # `Result.return_value`): in memory only, it need not be JSON.
        self.return_value: Any = None
        self.dead_workers: set[str] = set()  # killed or lost: never given a rank again
        self.snapshots = SnapshotTier()  # which in-memory rounds a restart may take
        self._run_uri = plan.storage.uri(plan.name)
        self.start_failures = 0  # groups in a row that failed before every rank had joined
        self._watching = self._warming = False
        self._segment: Segment | None = None  # a checkpoint committed by the last step
        self._last_progress_log = self.clock.monotonic()
        self._last_round_at: datetime | None = None  # when the newest round reached the driver
        # log and warn through self: a caller may replace them after construction
        self._watch = GroupWatch(
            self.events,
            cluster,
            failure_config,
            self.clock,
            lambda msg: self.log(msg),
            lambda msg: self.warn(msg),
        )

    # -- public -------------------------------------------------------------------------------

    def retries_left(self) -> int:
        return failure_policy.retries_left(self.state, self.failure_config.max_failures)

    def run_segment(self) -> Segment:
        """Train until the next committed checkpoint or the end of training."""
        if isinstance(self.current, Errored):
            raise self.current.error
        while not isinstance(self.current, Finished):
            nxt = self.step()
            if isinstance(nxt, Errored):
                raise nxt.error
            if isinstance(nxt, Restarting) and nxt.failure is not None and nxt.failure.charged:
                raise self._retry_error(nxt.failure)
            if self._segment is not None:
                segment, self._segment = self._segment, None
                return segment
        return Segment("finished", self.state.report_index, self.last_metrics)

    def step(self) -> State:
        """One transition from the current state, taken; returns the new state."""
        s = self.current
        if isinstance(s, Restarting):
            nxt = self._start_group()
        elif isinstance(s, Draining):
            nxt = self._await_last_reports(s)
        elif isinstance(s, (Running, Resizing, Preempting)):
            nxt = self._carry_out(self._watch.next(s))
        else:
            nxt = s  # terminal
        self._set_state(nxt)
        return nxt

    def lease_lost(self, why: str) -> None:
        """Another driver took the run over (from the lease's thread): stop training now."""
        self.events.put(LeaseLost(why))

    def abort(self, error: BaseException) -> None:
        """The driver is going away (Ctrl+C, SIGTERM, an unexpected error): record why, so the
        next flow run with the same name resumes, then stop the ranks."""
        if not self.current.is_terminal:
            if isinstance(error, Exception):
                self.state.status, self.state.error = "failed", f"{type(error).__name__}: {error}"
            else:  # KeyboardInterrupt, SystemExit, Prefect's TerminationSignal: not charged
                self.state.status = "interrupted"
                interrupt = FailureRecord(
                    kind=FailureKind.DRIVER_INTERRUPT,
                    error=type(error).__name__,
                    attempt=self._attempt(),
                    step=self._last_index(),
                    charged=False,
                    reports=self.state.reports,
                    last_report_at=self._last_round_at,
                )
                self.state.failures.append(interrupt)
                notify(self.callbacks, "on_failure", interrupt)
            # Crash ordering: the record first, so a driver killed while stopping still leaves it.
            try:
                self.store.save(self.state)
            except RunLockedError:
                pass  # the run is another driver's now: leave its state alone
        self._stop_now()
        if not self.current.is_terminal:
            self._set_state(Errored(TrainingFailedError(self.state.error or "interrupted")))

    # -- transitions --------------------------------------------------------------------------

    def _set_state(self, nxt: State) -> None:
        """Every transition passes here."""
        prev, self.current = self.current, nxt
        if nxt is not prev:
            logger.debug("controller: %s -> %s", type(prev).__name__, type(nxt).__name__)
            if nxt.is_terminal:
                notify(self.callbacks, "on_run_end", self.state)

    def _carry_out(self, o: State | Outcome) -> State:
        """What the watch said, done; the next state."""
        match o:
            case RoundComplete(state=s, round=rnd):
                return self._round_complete(s, rnd)
            case GroupFailed():
                return self._fail(o.state, o.rank, o.kind, o.error, o.step, o.traceback)
            case RestoreFailed(state=s, rank=rank, failure=exc):
                return self._restore_failed(s, rank, exc)
            case Preempted(state=s, jit=jit):
                return self._preempted(s, jit)
            case Resized(attempt=attempt):
                return self._resized(attempt)
            case Returned(state=s):
                return self._returned(s)
            case GroupUp(state=s):
                self.start_failures = 0  # every rank started: the group is up
                self._warm_workers()
                return s
            case Ended(error=error, record=record, stop=stop):
                if stop:
                    self._stop_now()
                return self._errored(error, record)
        return o

    def _start_group(self) -> State:
        self.store.fence()  # no ranks for a run that is another driver's now
        attempt = len(self.state.attempts)
        if not self._watching:  # on every worker, and on those that join later
            self.cluster.watch_preemption(self.failure_config.preemption_notice_s)
            self.cluster.hold_snapshots()
            self._watching = True
        group = self.cluster.new_group(attempt, self.events, self._run_uri)
        group.place(self.plan, self.dead_workers)
        snap = self._snapshot_to_restore()
        start = snap.index if snap is not None else self.state.report_index
        group.start(self.plan, self.state.latest, start, snap)
        self.snapshots.started(group.attempt_id, snap)
        record = AttemptRecord(
            attempt=attempt,
            attempt_id=group.attempt_id,
            world_size=len(group.addresses),
            restored_from=self.state.latest,
            start_report_index=start,
            restored_snapshot=snap.name if snap else None,
        )
        self.state.attempts.append(record)
        self.state.status, self.state.reports = "running", start
        self.store.save(self.state)
        where = f"checkpoint {self.state.latest}" if self.state.latest else "scratch"
        where = f"in-memory {snap.name}" if snap is not None else where
        self.log(f"attempt {attempt}: {plural(len(group.addresses), 'rank')} started from {where}")
        notify(self.callbacks, "on_attempt_started", record)
        return Running(Attempt(group, ReportRounds(len(group.addresses), start)))

    def _snapshot_to_restore(self) -> SnapshotRound | None:
        """The newest complete snapshot round of this driver's lineage newer than the latest
        checkpoint on storage, if the holders still have one (`ft_train.snapshots.rounds`)."""
        if not self.snapshots.lineage:
            return None
        held = self.cluster.held_snapshots(self._run_uri)
        return self.snapshots.choose(held, self.state.report_index)

    def _warm_workers(self) -> None:
        """Once the first group is up, have every worker import torch and `cluster.preload` (the
        spare, and those that join later: a failed rank's replacement then starts at once). Not
        sooner: on a small machine the imports would slow the run's start."""
        if not self._warming:
            self._warming = True
            self.cluster.warm(TORCH + self.plan.warm)

    def _round_complete(self, s: GroupState, rnd: Round) -> State:
        """A running group's round: hand it out; after a checkpoint, a group whose workers are
        leaving stops (the checkpoint was their just-in-time one), and an elastic group below
        max_workers with workers to spare stops at its next report (a resize, not a failure)
        to start a larger one from this checkpoint."""
        after = self._on_round(s, rnd)
        if rnd.dir_name is None or after is not s:  # no checkpoint, or one the run cannot take
            return after
        if isinstance(s, Preempting) and s.boundary:
            return self._preempted(s, rnd.dir_name)
        group = s.attempt.group
        if isinstance(s, Running) and self.cluster.can_grow(
            self.plan, group.addresses, self.dead_workers
        ):
            group.request_stop()
            return Resizing(s.attempt)
        return s

    def _on_round(self, s: State, rnd: Round) -> State:
        """A round every rank reported: commit its checkpoint, if it has one."""
        self.last_metrics = rnd.metrics
        self._progressed(rnd.index)
        notify(self.callbacks, "on_report", rnd.index, rnd.metrics)
        if rnd.dir_name is None:
            if self.clock.monotonic() - self._last_progress_log > knobs.PROGRESS_LOG_EVERY_S:
                self._last_progress_log = self.clock.monotonic()
                self.log(f"report {rnd.index}: {_fmt(rnd.metrics)}")
            notify(self.callbacks, "on_round_done", rnd.index, rnd.rank_metrics, None)
            return s
        if (conflict := label_conflict(rnd)) is not None:
            return self._errored(SessionError(conflict))
        if not rnd.files:  # restored, it would be an empty directory: as if from scratch
            return self._errored(
                SessionError(
                    f"report() {rnd.index}: the checkpoint holds no files on any rank; save the "
                    "checkpoint's files into it before report(), or report without checkpoint="
                )
            )
        self._commit(rnd)
        self._segment = Segment("checkpoint", rnd.index, rnd.metrics, rnd.dir_name)
        return s

    def _commit(self, rnd: Round, how: str = "") -> None:
        assert rnd.dir_name is not None  # a round with a checkpoint
        if (conflict := label_conflict(rnd)) is not None:
            # A recovered round (`_stop_group`): its files lie in several directories, and the
            # restart reports it again, where `_on_round` refuses it.
            self.log(f"round {rnd.index} not committed: {conflict}")
            return
        self.last_metrics = rnd.metrics
        self.state.reports = max(self.state.reports, rnd.index)  # saved with the commit
        if (shared := collision_warning(rnd)) is not None:  # DESIGN.md, storage invariant 3
            self.warn(shared)
        dropped = self.manager.commit(
            self.state, rnd.dir_name, rnd.index, rnd.metrics, rnd.files, self._attempt()
        )
        self.log(
            f"checkpoint {rnd.dir_name} committed at report {rnd.index}{how}: {_fmt(rnd.metrics)}"
            + (f" (deleted {len(dropped)} older)" if dropped else "")
        )
        notify(self.callbacks, "on_checkpoint_committed", self.state.latest_entry(), self.state)
        notify(
            self.callbacks, "on_round_done", rnd.index, rnd.rank_metrics, self.state.latest_entry()
        )

    def _await_last_reports(self, s: Draining) -> State:
        """Every rank returned: wait for its reports still in flight, then finish."""
        rounds = s.attempt.rounds
        if (rnd := rounds.pop_complete()) is not None:
            return self._on_round(s, rnd)  # the next call finishes
        if rounds.last_index >= s.expected:
            return self._finished(s.attempt)
        if self.clock.monotonic() >= s.deadline:
            lost = f"reports {rounds.last_index + 1}..{s.expected} never reached the driver"
            return self._fail(s, 0, FailureKind.EXCEPTION, lost, step=rounds.last_index)
        try:
            wait = max(0.0, s.deadline - self.clock.monotonic())
            event = self.clock.next_event(self.events, wait)
        except queue.Empty:
            return s
        if isinstance(event, Reported) and isinstance(event.message, Report):
            if event.attempt == s.attempt.group.attempt:
                rounds.add(event.message)
        return s

    def _finished(self, attempt: Attempt) -> State:
        attempt.group.release()
        self.return_value = self._return_value(attempt)
        attempt.group.read_journals()  # every report arrived: the journals only take room now
        self.cluster.drop_snapshots(self._run_uri)  # and the snapshots
        self.state.status, self.state.reports = "finished", attempt.rounds.last_index
        self.state.final_metrics = self.last_metrics
        self.store.save(self.state)
        self.manager.collect_orphans(self.state)
        self.log(
            f"training finished after {plural(attempt.rounds.last_index, 'report')}: "
            f"{_fmt(self.last_metrics)}"
        )
        return Finished()

    def _return_value(self, attempt: Attempt) -> Any:
        """Rank 0's return value, pickled on its worker (`ft_train.worker.rank`); None if it
        returned None. One that cannot be unpickled here (its class cannot be imported by the
        driver) is given up with a warning: training itself finished."""
        pickled = attempt.done.get(0, {}).get("return_value")
        if pickled is None:
            return None
        try:
            return pickle.loads(pickled)  # cloudpickle's output is plain pickle
        except Exception as e:
            self.warn(
                f"the training function's return value on rank 0 cannot be unpickled by the "
                f"driver ({type(e).__name__}: {e}); result.return_value is None: make its class "
                "importable where the flow runs"
            )
            return None

    def _returned(self, s: GroupState) -> State:
        """Every rank returned from its training function: check they reported alike, then
        drain their last reports."""
        counts = {r: d["reports"] for r, d in sorted(s.attempt.done.items())}
        if len(set(counts.values())) > 1:
            return self._errored(
                SessionError(
                    f"ranks called report() a different number of times ({counts}); every rank must "
                    "call report() the same number of times"
                )
            )
        deadline = self.clock.monotonic() + knobs.REPORT_DRAIN_TIMEOUT_S
        return Draining(s.attempt, counts[0], deadline)

    # -- failures -----------------------------------------------------------------------------

    def _stop_group(self, attempt: Attempt, kill_first=(), lost=()) -> set[int]:
        """Stop the group, then commit the newest round that all of its ranks reported, from
        their journals: a rank's last reports may have died with it, but not its journal
        (`ft_train.worker.journal`). Returns the ranks that had joined the process group.

        Crash ordering: the commit comes before the failure is recorded, so the next group
        restores from it; a driver killed in between leaves a committed checkpoint."""
        self.dead_workers |= attempt.group.stop(grace_s=self.stop_grace_s, kill_first=kill_first)
        journals = attempt.group.read_journals(skip=lost)
        if (got := reached(journals, len(attempt.group.addresses))) is not None:
            self._reached(got)  # reports that had not reached the driver count as progress
        if (rnd := attempt.rounds.recover(journals)) is not None:
            notify(self.callbacks, "on_report", rnd.index, rnd.metrics)
            self._commit(rnd, " (recovered from the ranks' journals)")
        return set(attempt.progress) | {r for r, j in journals.items() if "index" in j}

    def _fail(
        self,
        s: State,
        rank: int,
        kind: FailureKind,
        error: str,
        step: int | None = None,
        traceback: str = "",
    ) -> State:
        """Stop the group, record the failure (with the rank's `traceback` text, where it
        raised), and go where the failure policy says."""
        seen = now()  # the record's time: when the failure was seen, not when the ranks stopped
        attempt = s.attempt  # type: ignore[union-attr]
        address = attempt.group.addresses[rank]
        joined = self._stop_group(
            attempt,
            kill_first={address} if kind in (FailureKind.EXCEPTION, FailureKind.HANG) else set(),
            lost={address} if kind is FailureKind.NODE_LOSS else set(),
        )
        # Only a group some of whose ranks never joined failed to start; a rank that died after
        # it joined is an ordinary failure, whether or not its "started" reached the driver.
        everyone = len(joined) == len(attempt.group.addresses)
        self.start_failures = 0 if everyone else self.start_failures + 1
        rounds = attempt.rounds
        if step is None:
            step = rounds.received.get(rank, rounds.last_index)
        return self._judge(
            FailureRecord(
                kind=kind,
                rank=rank,
                step=step,
                error=error,
                attempt=attempt.group.attempt,
                time=seen,
                traceback=traceback,
            )
        )

    def _restore_failed(self, s: GroupState, rank: int, exc: RankFailure) -> State:
        """A rank raised on what its group restored from (`exc.damaged`). A snapshot round:
        restart from the next newest round, or storage, uncharged (the tier is a bonus above
        storage, and each round is given up once, so this cannot loop). The latest checkpoint,
        found damaged (its files do not match its manifest): no restart from it can succeed;
        the checkpoint manager drops it, the next group restores from the one before, and the
        failure is not charged (each damaged checkpoint is dropped once). Its group restored
        nothing, so no round of it is recovered. Otherwise a failure like any other."""
        state, group = self.state, s.attempt.group
        if self.snapshots.unusable(exc.damaged or ""):
            self.dead_workers |= group.stop(grace_s=self.stop_grace_s)
            error = f"{exc.error}; the run goes on from an older snapshot or from storage"
            return self._judge(self._uncharged(rank, exc.step, error, group.attempt))
        damaged = state.latest
        if exc.damaged != self.manager.latest_uri(state):
            return self._fail(
                s, rank, FailureKind.EXCEPTION, exc.error, exc.step, traceback=exc.traceback
            )
        previous = self.manager.drop_damaged(state)
        if previous is None:  # nothing to fall back to: a failure like any other
            error = (
                f"{exc.error}; no earlier checkpoint is kept (raise "
                "run_config.checkpoint_config.num_to_keep to keep one)"
            )
            return self._fail(s, rank, FailureKind.EXCEPTION, error, exc.step, exc.traceback)
        self.dead_workers |= group.stop(grace_s=self.stop_grace_s)
        self.warn(
            f"checkpoint {damaged} is damaged ({exc.error}); restoring from "
            f"{previous.dir_name} (report {previous.report_index})"
        )
        error = (
            f"{exc.error}; checkpoint {damaged} dropped, the run goes on from "
            f"{previous.dir_name} (report {previous.report_index})"
        )
        return self._judge(self._uncharged(rank, exc.step, error, group.attempt))

    @staticmethod
    def _uncharged(rank: int, step: int, error: str, attempt: int) -> FailureRecord:
        return FailureRecord(
            kind=FailureKind.EXCEPTION,
            rank=rank,
            step=step,
            error=error,
            attempt=attempt,
            charged=False,
        )

    def _preempted(self, s: Preempting, jit: str | None) -> State:
        """Workers are leaving: stop the group, let them go, record a preemption (charged to
        max_preemption_failures only) and restart; the next group starts from the latest
        committed checkpoint, which is the just-in-time one (`jit`) when the loop saved it."""
        group, leaving = s.attempt.group, s.workers
        # They go now rather than at their deadline; the other ranks then fail on their own at
        # once (gloo sees the closed connections) and keep their processes.
        self._stop_group(s.attempt, kill_first=leaving)
        self.dead_workers |= leaving
        step = s.attempt.rounds.last_index
        ranks = [group.addresses.index(a) for a in leaving if a in group.addresses]
        what = f"saved {jit} in time" if jit else "no checkpoint was saved in time"
        self.log(f"ranks {ranks} preempted {after_report(step)}: {what}; restarting elsewhere")
        return self._judge(
            FailureRecord(
                kind=FailureKind.PREEMPTION,
                rank=min(ranks, default=None),
                step=step,
                error=f"worker(s) {sorted(leaving)} told to leave; {what}",
                attempt=group.attempt,
                charged=False,
            )
        )

    def _resized(self, attempt: Attempt) -> State:
        """The ranks left their training function at the driver's request: start a larger
        group from the latest committed checkpoint."""
        attempt.group.release()
        # the ranks' last reports may still be on their way: their journals have them
        if (rnd := attempt.rounds.recover(attempt.group.read_journals())) is not None:
            self._commit(rnd, " (recovered from the ranks' journals)")
        self.log(
            f"growing the group of {plural(len(attempt.group.addresses), 'rank')} "
            "(a resize, not a failure)"
        )
        return Restarting()

    def _judge(self, failure: FailureRecord) -> State:
        """Record `failure` and go where the failure policy says: Restarting, or Errored."""
        cfg = self.failure_config
        if failure.reports is None:  # the run's progress when it failed: what a restart costs
            failure.reports, failure.last_report_at = self.state.reports, self._last_round_at
        self.state.failures.append(failure)
        notify(self.callbacks, "on_failure", failure)
        decision = failure_policy.decide(
            failure, self.state, cfg.max_failures, cfg.max_preemption_failures, self.start_failures
        )
        if decision is failure_policy.Decision.RAISE:
            if failure.traceback:  # the run ends on it: not an expected failure, show where
                self.warn(f"rank {failure.rank} {after_report(failure.step)}:\n{failure.traceback}")
            return self._errored(
                failure_policy.final_error(failure, self.state, cfg, self.start_failures)
            )
        self.store.save(self.state)
        return Restarting(failure)

    def _errored(self, error: FtTrainError, record: bool = True) -> State:
        """The run has failed for good: record it (unless the run is no longer this driver's:
        then only stop the ranks)."""
        if record:
            text = (
                str(error)
                if isinstance(error, TrainingFailedError)
                else f"{type(error).__name__}: {error}"
            )
            self.state.status, self.state.error = "failed", text
            self.state.error_type = type(error).__name__
            self.store.save(self.state)
            self.cluster.drop_snapshots(self._run_uri)
        else:
            self._stop_now()
        return Errored(error)

    def _retry_error(self, failure: FailureRecord) -> AttemptFailed:
        max_failures = self.failure_config.max_failures
        budget = (
            "unlimited"
            if max_failures == -1
            else f"{self.state.charged_failures} of {max_failures}"
        )
        state = self.state
        where = f"{state.latest} (report {state.report_index})" if state.latest else "scratch"
        if self.plan.snapshot_every:  # only a run that keeps in-memory snapshots is told of them
            where = (
                f"the newest in-memory snapshot still held, if newer than report "
                f"{state.report_index}, else from {where}"
            )
        error = failure.error.splitlines()[0] if failure.error else ""
        return AttemptFailed(
            f"rank {failure.rank} failed ({failure.kind}) {after_report(failure.step)}: {error}. "
            f"Restarting from {where} (failure {budget} allowed by max_failures)",
            failure.model_dump(mode="json"),
        )

    def _progressed(self, index: int) -> None:
        """Round `index` reached the driver: the run's progress, and the end of a restart's gap
        at the attempt's first round (saved with the next write of the run state)."""
        self._last_round_at = now()
        self.state.reports = index
        record = self.state.attempts[-1] if self.state.attempts else None
        if record is not None and record.first_report_at is None:
            record.first_report_at = self._last_round_at

    def _reached(self, got: Reached) -> None:
        """What the stopped group's journals say every rank reached: the run's progress, if
        newer than the rounds the driver has (their reports may have died queued in a rank);
        and when the attempt first reported, if none of its reports reached the driver."""
        if got.index > self.state.reports:
            self.state.reports = got.index
            self._last_round_at = datetime.fromtimestamp(got.at, UTC)
        record = self.state.attempts[-1] if self.state.attempts else None
        if record is not None and record.first_report_at is None and got.first_at is not None:
            record.first_report_at = datetime.fromtimestamp(got.first_at, UTC)

    def _stop_now(self) -> None:
        """Stop the running group's ranks at once, if any; the driver is leaving the run."""
        attempt = getattr(self.current, "attempt", None)
        if attempt is not None:
            try:
                attempt.group.stop(grace_s=0.0)
            except Exception as e:  # leaving anyway; a local cluster dies with the driver
                self.log(f"could not stop every rank ({type(e).__name__}: {e})")

    @property
    def stop_grace_s(self) -> float:
        return 0.0 if self.plan.use_gpu else knobs.STOP_GRACE_S

    def _attempt(self) -> int:
        return len(self.state.attempts) - 1

    def _last_index(self) -> int:
        attempt = getattr(self.current, "attempt", None)
        return attempt.rounds.last_index if attempt is not None else self.state.report_index


def _fmt(metrics: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(metrics.items())[:6]
    )
