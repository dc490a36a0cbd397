"""The controller: runs worker-group attempts until the next committed checkpoint.

One call of `run_segment()` is one stretch of training between two checkpoints (one Prefect task
run). A group failure stops every rank, is recorded in the run state, and is judged by the failure
policy: RETRY raises `WorkerGroupError` (the caller retries `run_segment`, which restarts the
group from the latest committed checkpoint); RAISE raises `TrainingFailedError`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Container, Iterable, Literal, Optional

from distributed import KilledWorker

from .. import failure_policy
from ..checkpoint_manager import CheckpointManager
from ..config import FailureConfig
from ..errors import (
    FtTrainError,
    RankFailure,
    RunLockedError,
    SessionError,
    TrainingFailedError,
    WorkerGroupError,
)
from ..failure_policy import Decision
from ..run_state import AttemptRecord, FailureRecord, RunState, RunStore, now
from ..preemption import PreemptionWatcher
from ..warm import TORCH, WarmImports
from ..worker_group import ANSWER_TIMEOUT_S, GroupPlan, WorkerGroup, more_workers_available
from .rounds import ReportRounds, Round
from .state import Errored, Finished, Idle, Preempting, Running

logger = logging.getLogger("ft_train")

# How long the other ranks of a failed group get to fail on their own before their processes
# are killed. gloo notices a dead peer at once; NCCL may not, and a CUDA context is not to be
# trusted after a failure, so GPU ranks are always killed.
STOP_GRACE_S = 3.0
# A rank that failed because it lost a peer ("connection closed by peer", a collective timeout)
# is judged after this long, so the failure is charged to its cause when that cause shows up.
COLLATERAL_WAIT_S = 2.0
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "timed out")
# Workers given notice leave at their deadline; if the driver has heard nothing by this long
# after it (a retired worker's process gone without a word), the group is stopped anyway.
NOTICE_SLACK_S = 1.0


def _lost_a_peer(error: str) -> bool:
    return any(p in error.lower() for p in _PEER_LOST)


# After every rank returned, wait this long for their last reports still in flight.
REPORT_DRAIN_TIMEOUT_S = 30.0


def hung_rank(
    ranks: Iterable[int], done: Container[int], waiting: Optional[int],
    received: dict[int, int], progress: dict[int, float],
) -> int:
    """The rank to blame when the watchdog fires: of the ranks still running, except `waiting`
    (one that failed waiting for a peer), the one with the fewest reports received, then the
    one heard from least recently; a rank never heard from at all (`received` and `progress`
    lack it) first. `waiting` itself when every other rank has returned."""
    running = [r for r in ranks if r not in done and r != waiting]
    return min(running, key=lambda r: (received.get(r, 0), progress.get(r, 0.0)), default=waiting)


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
        self.rounds = ReportRounds(plan.max_workers, state.report_index)
        self.done: dict[int, dict] = {}
        self.last_metrics: dict[str, Any] = {}
        self.dead_workers: set[str] = set()
        # rank -> when it last reported, or started (monotonic); what the hang watchdog watches
        self.progress: dict[int, float] = {}
        # (rank, error, deadline): a rank that failed because a peer did, awaiting the cause
        self.collateral: Optional[tuple[int, RankFailure, float]] = None
        self.preempting: Optional[Preempting] = None
        self.start_failures = 0  # groups in a row that failed before every rank started
        self.resizing = False
        self._plugins_installed = False
        self._warming = False
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
        while True:
            if isinstance(self.phase, Idle):  # also after a preemption without a checkpoint
                self._start_group()
            segment = self._drain_rounds()
            if segment is not None:
                return segment
            if len(self.done) == len(self.phase.group.addresses):
                if any(d.get("stopped") for d in self.done.values()):
                    self._resized()
                    continue
                return self._finish()
            try:
                event = self.events.get(timeout=self._next_deadline())
            except queue.Empty:
                self._on_deadline()
                continue
            segment = self._handle(event)
            if segment is not None:
                return segment

    def lease_lost(self, why: str) -> None:
        """Another driver took the run over (from the lease's thread): stop training now."""
        self.events.put(("lease_lost", None, why))

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
            try:
                self.store.save(self.state)
            except RunLockedError:
                pass  # the run is another driver's now: leave its state alone
        self._stop_now()
        if not self.phase.is_terminal:
            self.phase = Errored(TrainingFailedError(self.state.error or "interrupted"))

    # -- transitions --------------------------------------------------------------------------

    def _attempt(self) -> int:
        return len(self.state.attempts) - 1

    def _start_group(self) -> None:
        self.store.fence()  # no ranks for a run that is another driver's now
        attempt = len(self.state.attempts)
        group = WorkerGroup(self.client, attempt, self.events, self.plan.storage.uri(self.plan.name))
        self.done = {}
        self.collateral = None
        self.resizing = False
        if not self._plugins_installed:  # on every worker, and on those that join later
            plugin = PreemptionWatcher(self.failure_config.preemption_grace_s)
            self._register(plugin, ANSWER_TIMEOUT_S, logger.warning)  # else no preemption notice
            self._plugins_installed = True
        group.start(self.plan, self.state.latest, self.state.report_index, self.dead_workers)
        self.rounds = ReportRounds(len(group.addresses), self.state.report_index)
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
        self.progress = {}  # a rank is watched from its "started" message on
        self.phase = Running(group)

    def _handle(self, event: tuple) -> Optional[Segment]:
        kind, attempt = event[0], event[1]
        if kind == "lease_lost":
            self._raise(RunLockedError(event[2]), record=False)
        if not isinstance(self.phase, Running) or attempt != self.phase.group.attempt:
            return None  # a late event from a group already stopped
        if kind == "report":
            msg = event[2]
            self.progress[msg["rank"]] = time.monotonic()
            if "index" in msg:  # else the rank's "started": it joined the process group
                self.rounds.add(msg)
            elif len(self.progress) == len(self.phase.group.addresses):
                self.start_failures = 0  # every rank started: the group is up
                self._warm_workers()
            return None
        if kind == "preempt_notice":
            if event[2] in self.phase.group.addresses:
                self._note_preemption({event[2]}, event[3], boundary=False)
            return None
        if kind == "worker_lost" and self.preempting and event[2] in self.preempting.workers:
            self._preempted(self.rounds.last_index, jit=None)  # it left before a checkpoint
            return None
        if kind == "worker_lost" and event[3]:
            # Retired on purpose (Client.retire_workers): the scheduler has let it go, but its
            # process stays while its rank runs. Give the ranks notice, as SIGTERM would.
            deadline = time.time() + self.failure_config.preemption_grace_s
            self.phase.group.give_notice(event[2], deadline)
            self._note_preemption({event[2]}, deadline, boundary=False)
            return None
        if kind == "worker_lost":
            self._lost(event[2])
        if kind == "rank_done":
            return self._rank_done(event[2], event[3])
        return None

    def _warm_workers(self) -> None:
        """Once the first group is up, have every worker import torch and `cluster.preload` (the
        spare, and those that join later: a failed rank's replacement then starts at once). Not
        sooner: on a small machine the imports would slow the run's start. On a thread: the
        spare takes seconds."""
        if self._warming:
            return
        self._warming = True
        # the run may be over before it is done: no matter, the workers only start cold
        self._register(WarmImports(TORCH + self.plan.warm), 0.0, logger.debug)

    def _register(self, plugin, wait_s: float, failed: Callable[[str], None]) -> None:
        """Register a worker plugin, waiting up to `wait_s` for it. The scheduler keeps it for
        the workers that join later at once, then hands it to every worker in one broadcast,
        which a frozen worker holds until the scheduler drops it (worker-ttl): so on a thread.
        The workers that answer have it within milliseconds."""

        def register() -> None:
            try:
                self.client.register_plugin(plugin)
            except Exception as e:
                failed(f"ft-train: could not register {plugin.name} ({type(e).__name__}: {e})")

        thread = threading.Thread(target=register, name=plugin.name, daemon=True)
        thread.start()
        thread.join(wait_s)

    def _rank_raised(self, rank: int, exc: RankFailure) -> None:
        """Fail the group (raises), unless the rank found the checkpoint it restores from damaged
        and an earlier one is kept: then go Idle, to restore from that one."""
        self.log(f"rank {rank} raised at step {exc.step}:\n{exc.traceback}")
        if exc.damaged is None or exc.damaged != self.manager.latest_uri(self.state):
            self._fail(rank, "exception", exc.error, step=exc.step)
        earlier = [c for c in self.state.checkpoints if c.dir_name != self.state.latest]
        if not earlier:  # nothing to fall back to: a failure like any other
            self._fail(rank, "exception", f"{exc.error}; no earlier checkpoint is kept (raise "
                       "run_config.checkpoint_config.num_to_keep to keep one)", step=exc.step)
        self._fall_back(rank, exc, earlier)

    def _fall_back(self, rank: int, exc: RankFailure, earlier: list) -> None:
        """The latest checkpoint is damaged (its files do not match its manifest): no restart
        from it can succeed. Drop it from the run, so that the next group restores from the
        checkpoint before it, and record a failure not charged to max_failures (each damaged
        checkpoint is dropped once, so this cannot loop). Its directory, no longer referenced, is
        left to the orphan sweep."""
        group, damaged = self.phase.group, self.state.latest
        previous = max(earlier, key=lambda c: c.report_index)
        self.dead_workers |= group.stop(grace_s=0.0 if self.plan.use_gpu else STOP_GRACE_S)
        self.state.checkpoints = earlier
        self.state.latest, self.state.report_index = previous.dir_name, previous.report_index
        self.log(f"checkpoint {damaged} is damaged ({exc.error}); restoring from "
                 f"{previous.dir_name} (step {previous.report_index})")
        self._judge(
            FailureRecord(
                kind="exception",
                rank=rank,
                step=exc.step,
                error=f"{exc.error}; checkpoint {damaged} dropped, the run goes on from "
                f"{previous.dir_name} (step {previous.report_index})",
                attempt=group.attempt,
                charged=False,
            )
        )

    def _next_deadline(self) -> Optional[float]:
        """Seconds until the controller must act without an event: a watchdog or a judgement."""
        waits = [self._watchdog_remaining()]
        if self.collateral is not None:
            waits.append(max(0.0, self.collateral[2] - time.monotonic()))
        if self.preempting is not None:
            waits.append(max(0.0, self.preempting.deadline + NOTICE_SLACK_S - time.time()))
        return min((w for w in waits if w is not None), default=None)

    def _on_deadline(self) -> None:
        if self.preempting is not None and time.time() >= self.preempting.deadline + NOTICE_SLACK_S:
            self._preempted(self.rounds.last_index, jit=None)  # the notice ran out
        if self.collateral is not None and time.monotonic() >= self.collateral[2]:
            rank, exc, _ = self.collateral
            if self.preempting is not None:  # it lost a peer that was leaving
                self._preempted(self.rounds.last_index, jit=None)
                return
            if gone := self._gone_workers():  # the peer it lost, whose event is late
                self._lost(gone[0])
            laggard = self._laggard(rank, exc.step)
            if laggard is not None and "timed out" in exc.error.lower():
                # A collective timed out waiting for a rank that stopped making progress.
                self._fail(laggard, "hang", f"no progress; rank {rank} timed out waiting for it")
            self._rank_raised(rank, exc)
            return  # fell back to an earlier checkpoint
        if (remaining := self._watchdog_remaining()) is not None and remaining <= 0:
            self._hung()

    def _gone_workers(self) -> list[str]:
        """The group's workers the scheduler no longer lists. Should the "worker_lost" event of
        one come later than COLLATERAL_WAIT_S after a peer's error (a loaded machine), a rank
        that only lost that peer would be blamed without this look, and its healthy worker
        killed: on a cluster without nannies, lost for the rest of the run."""
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        return [a for a in self.phase.group.addresses if a not in alive]

    def _lost(self, address: str) -> None:
        """The scheduler let a rank's worker go: fail the group (raises)."""
        group = self.phase.group
        kind = group.lost_kind(address)
        what = "process died" if kind == "process_death" else "node left the cluster"
        self._fail(group.addresses.index(address), kind, f"worker {address}: {what}")

    def _watchdog_remaining(self) -> Optional[float]:
        """Seconds until the slowest running rank counts as hung; None without a watchdog."""
        timeout = self.failure_config.hang_timeout_s
        waiting = [t for r, t in self.progress.items() if r not in self.done]
        if timeout is None or not waiting:
            return None
        return max(0.0, min(waiting) + timeout - time.monotonic())

    def _laggard(self, rank: int, step: int) -> Optional[int]:
        """When `rank` timed out in a collective at `step`: the rank it waited for, one still
        running and not ahead of it (the furthest behind first), if any."""
        running = [r for r in self._ranks() if r not in self.done and r != rank]
        lagging = [r for r in running if self.rounds.received.get(r, 0) <= step]
        return min(lagging, key=lambda r: self.rounds.received.get(r, 0), default=None)

    def _ranks(self) -> range:
        """Every rank of the running group, also one whose "started" message has not arrived (a
        rank's messages are handed over in batches: one that froze or hung early may never send
        it)."""
        return range(len(self.phase.group.addresses))

    def _hung(self) -> None:
        """No report from some rank within hang_timeout_s. The hung rank is the one furthest
        behind; the others usually wait for it in a collective (and one that already failed
        waiting for a peer is not the hung one)."""
        waiting = self.collateral[0] if self.collateral is not None else None
        rank = hung_rank(self._ranks(), self.done, waiting, self.rounds.received, self.progress)
        timeout = self.failure_config.hang_timeout_s
        self._fail(rank, "hang", f"no report() for {timeout:g}s (failure_config.hang_timeout_s)")

    def _rank_done(self, rank: int, future) -> Optional[Segment]:
        if future.status == "finished":
            self.done[rank] = future.result()
            return None
        if future.status == "cancelled":
            self._fail(rank, "node_loss", "the rank's Dask task was cancelled")
        exc = future.exception()
        if isinstance(exc, RankFailure) and exc.fatal:
            self.phase.group.stop(grace_s=0.0)
            self.log(f"rank {rank} broke the training function's contract:\n{exc.traceback}")
            raise SessionError(exc.error.split(": ", 1)[-1])
        if isinstance(exc, RankFailure):
            if self.collateral is None and _lost_a_peer(exc.error):
                # Most likely the echo of another rank's failure, whose own signal (a lost
                # worker, a killed process, a hung peer) may still be on its way: wait for it.
                self.collateral = (rank, exc, time.monotonic() + COLLATERAL_WAIT_S)
                return None
            self._rank_raised(rank, exc)
            return None  # fell back to an earlier checkpoint
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
        if rnd.preempted is not None:
            group = self.phase.group
            leaving = {group.addresses[r] for r in rnd.preempted}
            self._note_preemption(leaving, rnd.deadline, boundary=True)
        if rnd.dir_name is None:
            if time.monotonic() - self._last_progress_log > 10:
                self._last_progress_log = time.monotonic()
                self.log(f"step {rnd.index}: {_fmt(rnd.metrics)}")
            return None
        self._commit(rnd)
        if self.preempting is not None and self.preempting.boundary:
            self._preempted(rnd.index, jit=rnd.dir_name)
        elif not self.resizing and more_workers_available(
            self.client, self.plan, self.phase.group.addresses, self.dead_workers
        ):
            # An elastic group below max_workers, and workers to spare: stop it at the next
            # report (a resize, not a failure) and start a larger one from this checkpoint.
            self.resizing = True
            self.phase.group.request_stop()
        return Segment("checkpoint", rnd.index, rnd.metrics, rnd.dir_name)

    def _commit(self, rnd: Round, how: str = "") -> None:
        self.last_metrics = rnd.metrics
        dropped = self.manager.commit(
            self.state, rnd.dir_name, rnd.index, rnd.metrics, rnd.files, self._attempt()
        )
        self.log(
            f"checkpoint {rnd.dir_name} committed at step {rnd.index}{how}: {_fmt(rnd.metrics)}"
            + (f" (deleted {len(dropped)} older)" if dropped else "")
        )

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
            if event[0] == "report" and "index" in event[2]:
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
        seen = now()  # the record's time: when the failure was seen, not when the ranks stopped
        group = self.phase.group
        failed = {group.addresses[rank]} if kind in ("exception", "hang") else set()
        lost = {group.addresses[rank]} if kind == "node_loss" else set()
        joined = self._stop_group(kill_first=failed, lost=lost)
        # Only a group some of whose ranks never joined failed to start; a rank that died after
        # it joined is an ordinary failure, whether or not its "started" reached the driver.
        self.start_failures = 0 if len(joined) == len(group.addresses) else self.start_failures + 1
        failure = FailureRecord(
            kind=kind,
            rank=rank,
            step=step if step is not None else self.rounds.received.get(rank, self.rounds.last_index),
            error=error,
            attempt=group.attempt,
            time=seen,
        )
        self._judge(failure)
        max_failures = self.failure_config.max_failures
        budget = "unlimited" if max_failures == -1 else f"{self.state.charged_failures} of {max_failures}"
        raise WorkerGroupError(
            f"rank {rank} failed ({kind}) at step {failure.step}: {error}. Restarting from "
            f"{self.state.latest or 'scratch'} (failure {budget} allowed by max_failures)",
            failure.model_dump(mode="json"),
        )

    def _stop_group(self, kill_first: Collection[str] = (), lost: Collection[str] = ()) -> set[int]:
        """Stop the running group, then commit the newest round that all of its ranks reported,
        from their journals: a rank's last reports may have died with it, but not its journal
        (`ft_train.journal`). Returns the ranks that had joined the process group.

        Crash ordering: the commit comes before the failure is recorded, so the next group
        restores from it; a driver killed in between leaves a committed checkpoint."""
        group = self.phase.group
        grace = 0.0 if self.plan.use_gpu else STOP_GRACE_S
        self.dead_workers |= group.stop(grace_s=grace, kill_first=kill_first)
        journals = group.read_journals(skip=lost)
        rnd = self.rounds.recover(journals)
        if rnd is not None:
            self._commit(rnd, " (recovered from the ranks' journals)")
        return set(self.progress) | {r for r, j in journals.items() if "index" in j}

    def _judge(self, failure: FailureRecord) -> None:
        """Record `failure` and ask the failure policy. RAISE ends the run here (raises);
        RETRY leaves the controller Idle, to start a new group."""
        cfg = self.failure_config
        self.state.failures.append(failure)
        decision = failure_policy.decide(
            failure, self.state, cfg.max_failures, cfg.max_preemption_failures, self.start_failures
        )
        if decision is Decision.RAISE:
            self._raise(failure_policy.final_error(failure, self.state, cfg, self.start_failures))
        self.store.save(self.state)
        self.phase = Idle(after_failure=failure)

    def _raise(self, error: FtTrainError, record: bool = True) -> None:
        """The run has failed for good: record it (unless the run is no longer this driver's:
        then only stop the ranks) and raise."""
        if record:
            self.state.status, self.state.error = "failed", str(error)
            self.store.save(self.state)
        else:
            self._stop_now()
        self.phase = Errored(error)
        raise error

    def _stop_now(self) -> None:
        """Stop the running group's ranks at once, if any; the driver is leaving the run."""
        if isinstance(self.phase, Running):
            try:
                self.phase.group.stop(grace_s=0.0)
            except Exception as e:  # leaving anyway; a local cluster dies with the driver
                self.log(f"could not stop every rank ({type(e).__name__}: {e})")

    def _resized(self) -> None:
        """The ranks left their training function at the driver's request: start a larger group
        from the latest committed checkpoint."""
        group = self.phase.group
        group.release()
        # the ranks' last reports may still be on their way: their journals have them
        if (rnd := self.rounds.recover(group.read_journals())) is not None:
            self._commit(rnd, " (recovered from the ranks' journals)")
        self.resizing = False
        self.log(f"growing the group of {len(group.addresses)} ranks (a resize, not a failure)")
        self.phase = Idle()

    # -- preemption ---------------------------------------------------------------------------

    def _note_preemption(self, workers: set[str], deadline: float, boundary: bool) -> None:
        if self.preempting is None:
            self.preempting = Preempting(set(), deadline)
            self.log(f"workers {sorted(workers)} were told to leave by {deadline:.0f} (epoch s)")
        self.preempting.workers |= workers
        self.preempting.deadline = min(self.preempting.deadline, deadline)
        self.preempting.boundary |= boundary

    def _preempted(self, step: int, jit: Optional[str]) -> None:
        """Workers are leaving: stop the group, let them go, record a preemption (charged to
        max_preemption_failures only) and go Idle; the next group starts from the latest
        committed checkpoint, which is the just-in-time one (`jit`) when the loop saved it."""
        group, leaving = self.phase.group, self.preempting.workers
        self.preempting = None
        # They go now rather than at their deadline; the other ranks then fail on their own at
        # once (gloo sees the closed connections) and keep their processes.
        self._stop_group(kill_first=leaving)
        self.dead_workers |= leaving
        ranks = [group.addresses.index(a) for a in leaving if a in group.addresses]
        what = f"saved {jit} in time" if jit else "no checkpoint was saved in time"
        self.log(f"ranks {ranks} preempted at step {step}: {what}; restarting elsewhere")
        self._judge(
            FailureRecord(
                kind="preemption",
                rank=min(ranks, default=None),
                step=step,
                error=f"worker(s) {sorted(leaving)} told to leave; {what}",
                attempt=group.attempt,
                charged=False,
            )
        )


def _fmt(metrics: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(metrics.items())[:6]
    )
