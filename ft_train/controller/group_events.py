"""A running group's watch: what its events and deadlines mean, as outcomes the controller
carries out.

The controller asks `GroupWatch.next(s)` in Running, Resizing or Preempting. The answer is
either the next of those states (the group runs on: a report noted, a suspect set aside, workers
told to leave) or an outcome (the classes below) that the controller carries out: the
controller alone stops groups, commits checkpoints, records failures and asks the failure
policy, as Ray Train v2's controller executes the decisions its failure policy makes. The watch
owns the attempt's watch state (when each rank was last heard, the suspect, the deadlines) and
attributes failures (`ft_train.policy.attribution`); it writes nothing to the run, and of the
group's methods calls only those that pass word to its ranks (`give_notice`, `request_stop`).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass

from .. import knobs
from ..config import FailureConfig
from ..errors import FtTrainError, RankFailure, RunLockedError, SessionError
from ..policy.attribution import hung_rank, judge_suspect, laggard, lost_a_peer
from ..protocol import (
    GroupEvent,
    LeaseLost,
    PreemptNotice,
    RankEnded,
    Report,
    Reported,
    Started,
    WorkerLost,
)
from ..storage.run_state import FailureKind
from ..wording import after_report
from .clock import Clock
from .ports import Cluster
from .rounds import Round
from .state import Attempt, GroupState, Preempting, State, Suspect

logger = logging.getLogger("ft_train")

# -- outcomes: what the controller carries out -----------------------------------------------


@dataclass(frozen=True)
class RoundComplete:
    """Every rank reported `round`: hand it out, and commit its checkpoint if it has one.
    `state`: the group's state, with the workers the round said are leaving noted."""

    state: GroupState
    round: Round


@dataclass(frozen=True)
class GroupFailed:
    """Stop the group, record a failure of `rank` charged to max_failures, and go where the
    failure policy says."""

    state: GroupState
    rank: int
    kind: FailureKind
    error: str
    step: int | None = None  # None: the last report index received from the rank
    traceback: str = ""


@dataclass(frozen=True)
class RestoreFailed:
    """`rank` raised on what its group restored from (`failure.damaged`: a snapshot round, or
    a checkpoint): restart from an older one, uncharged, where there is one."""

    state: GroupState
    rank: int
    failure: RankFailure


@dataclass(frozen=True)
class Preempted:
    """Workers of the group are leaving, or left: stop the group, record a preemption and
    restart elsewhere. `jit`: the just-in-time checkpoint the ranks saved, if any."""

    state: Preempting
    jit: str | None = None


@dataclass(frozen=True)
class Resized:
    """The ranks left their training function at the driver's request: start a larger group."""

    attempt: Attempt


@dataclass(frozen=True)
class Returned:
    """Every rank returned from its training function."""

    state: GroupState


@dataclass(frozen=True)
class GroupUp:
    """Every rank of the group has started: no longer a group that fails to start."""

    state: GroupState


@dataclass(frozen=True)
class Ended:
    """The run ends with `error`. `record`: write it to the run state (not when the run is no
    longer this driver's); `stop`: stop the ranks at once first."""

    error: FtTrainError
    record: bool = True
    stop: bool = False


Outcome = (
    RoundComplete | GroupFailed | RestoreFailed | Preempted | Resized | Returned | GroupUp | Ended
)


class GroupWatch:
    """Watches the running group for the controller: `next(s)` is its whole interface."""

    def __init__(
        self,
        events: queue.Queue[GroupEvent],
        cluster: Cluster,
        failure_config: FailureConfig,
        clock: Clock,
        log: Callable[[str], None],
        warn: Callable[[str], None],
    ):
        self.events, self.cluster, self.failure_config = events, cluster, failure_config
        self.clock, self.log, self.warn = clock, log, warn

    def next(self, s: GroupState) -> State | Outcome:
        """The next complete round, the end of every rank, an event, or a deadline."""
        att = s.attempt
        if (rnd := att.rounds.pop_complete()) is not None:
            return self._round(s, rnd)
        if len(att.done) == len(att.group.addresses):
            if any(d.get("stopped") for d in att.done.values()):
                return Preempted(s) if isinstance(s, Preempting) else Resized(att)
            return Returned(s)
        try:
            event = self.clock.next_event(self.events, self._next_deadline(s))
        except queue.Empty:
            return self._on_deadline(s)
        return self._on_event(s, event)

    # -- events ----------------------------------------------------------------------------------

    def _round(self, s: GroupState, rnd: Round) -> RoundComplete:
        if rnd.preempted is not None:
            group = s.attempt.group
            leaving = {group.addresses[r] for r in rnd.preempted}
            s = self._noted(s, leaving, rnd.deadline or self.clock.time(), boundary=True)
        return RoundComplete(s, rnd)

    def _on_event(self, s: GroupState, event: GroupEvent) -> State | Outcome:
        if isinstance(event, LeaseLost):
            return Ended(RunLockedError(event.why), record=False)
        att = s.attempt
        if event.attempt != att.group.attempt:
            return s  # a late event from a group already stopped
        if isinstance(event, Reported):
            att.heard(event.message.rank, self.clock.monotonic())
            if isinstance(event.message, Report):
                att.rounds.add(event.message)
            elif isinstance(event.message, Started) and len(att.progress) == len(
                att.group.addresses
            ):
                return GroupUp(s)
            return s
        if isinstance(event, PreemptNotice):
            if event.address not in att.group.addresses:
                return s
            return self._noted(s, {event.address}, event.deadline, boundary=False)
        if isinstance(event, WorkerLost):
            return self._on_lost(s, event)
        if isinstance(event, RankEnded):
            return self._on_ended(s, event)
        return s

    def _on_lost(self, s: GroupState, event: WorkerLost) -> State | Outcome:
        if isinstance(s, Preempting) and event.address in s.workers:
            return Preempted(s)  # it left before a checkpoint
        if event.expected:
            # Retired on purpose (Client.retire_workers): the scheduler has let it go, but its
            # process stays while its rank runs. Give the ranks notice, as SIGTERM would.
            deadline = self.clock.time() + self.failure_config.preemption_notice_s
            s.attempt.group.give_notice(event.address, deadline)
            return self._noted(s, {event.address}, deadline, boundary=False)
        return self._lost(s, event.address)

    def _lost(self, s: GroupState, address: str) -> GroupFailed:
        """The scheduler let a rank's worker go: fail the group."""
        group = s.attempt.group
        kind = FailureKind(group.lost_kind(address))
        what = "process died" if kind is FailureKind.PROCESS_DEATH else "node left the cluster"
        return GroupFailed(s, group.addresses.index(address), kind, f"worker {address}: {what}")

    def _on_ended(self, s: GroupState, event: RankEnded) -> State | Outcome:
        att, rank, exc = s.attempt, event.rank, event.error
        if event.summary is not None:
            att.done[rank] = event.summary
            return s
        if event.cancelled:
            return GroupFailed(s, rank, FailureKind.NODE_LOSS, "the rank's Dask task was cancelled")
        if isinstance(exc, RankFailure) and exc.fatal:
            self.warn(f"rank {rank} broke the training function's contract:\n{exc.traceback}")
            return Ended(SessionError(exc.error.split(": ", 1)[-1]), stop=True)
        if isinstance(exc, RankFailure):
            if att.suspect is None and lost_a_peer(exc.error):
                # Most likely the echo of another rank's failure, whose own signal (a lost
                # worker, a killed process, a hung peer) may still be on its way: wait for it.
                deadline = self.clock.monotonic() + knobs.COLLATERAL_WAIT_S
                att.suspect = Suspect(rank, exc, deadline)
                return s
            return self._rank_raised(s, rank, exc)
        if event.worker_died:
            return GroupFailed(s, rank, FailureKind.PROCESS_DEATH, "the rank's worker process died")
        return GroupFailed(s, rank, FailureKind.PROCESS_DEATH, f"{type(exc).__name__}: {exc}")

    def _rank_raised(self, s: GroupState, rank: int, exc: RankFailure) -> Outcome:
        """Fail the group; where the rank raised on what it restored from, the controller
        may restart from something older instead."""
        # One line for what is expected of a fault-tolerant run; the traceback at DEBUG, and kept
        # in the failure's record (`ft-train status --json`, the UI's failures table).
        first_line = exc.error.splitlines()[0] if exc.error else ""
        self.warn(f"rank {rank} raised {after_report(exc.step)}: {first_line}")
        logger.debug("rank %d raised %s:\n%s", rank, after_report(exc.step), exc.traceback)
        if exc.damaged is not None:
            return RestoreFailed(s, rank, exc)
        return GroupFailed(
            s, rank, FailureKind.EXCEPTION, exc.error, step=exc.step, traceback=exc.traceback
        )

    # -- deadlines -------------------------------------------------------------------------------

    def _next_deadline(self, s: GroupState) -> float | None:
        """Seconds until the watch must act without an event: a watchdog or a judgement."""
        att = s.attempt
        waits = [self._watchdog_remaining(att)]
        if att.suspect is not None:
            waits.append(max(0.0, att.suspect.deadline - self.clock.monotonic()))
        if isinstance(s, Preempting):
            waits.append(max(0.0, s.deadline + knobs.NOTICE_SLACK_S - self.clock.time()))
        return min((w for w in waits if w is not None), default=None)

    def _on_deadline(self, s: GroupState) -> State | Outcome:
        att = s.attempt
        if isinstance(s, Preempting) and self.clock.time() >= s.deadline + knobs.NOTICE_SLACK_S:
            return Preempted(s)  # the notice ran out
        if att.suspect is not None and self.clock.monotonic() >= att.suspect.deadline:
            return self._judge_suspect(s, att.suspect)
        if (remaining := self._watchdog_remaining(att)) is not None and remaining <= 0:
            return self._hung(s)
        return s

    def _judge_suspect(self, s: GroupState, suspect: Suspect) -> Outcome:
        att, exc = s.attempt, suspect.failure
        ranks = range(len(att.group.addresses))
        gone = None
        if not isinstance(s, Preempting):
            # The group's workers the scheduler no longer lists. Should the lost event of one
            # come later than knobs.COLLATERAL_WAIT_S after a peer's error (a loaded machine), a
            # rank that only lost that peer would be blamed without this look, and its healthy
            # worker killed.
            alive = self.cluster.alive()
            gone = next((r for r in ranks if att.group.addresses[r] not in alive), None)
        lagging = laggard(ranks, att.done, suspect.rank, exc.step, att.rounds.received)
        blame = judge_suspect(suspect.rank, exc.error, isinstance(s, Preempting), gone, lagging)
        if blame.kind == "preemption" and isinstance(s, Preempting):  # it lost a leaving peer
            return Preempted(s)
        if blame.kind == "lost" and blame.rank is not None:
            return self._lost(s, att.group.addresses[blame.rank])
        if blame.kind == "hang" and blame.rank is not None:
            # A collective timed out waiting for a rank that stopped making progress.
            return GroupFailed(s, blame.rank, FailureKind.HANG, blame.error)
        return self._rank_raised(s, suspect.rank, exc)

    def _watchdog_remaining(self, att: Attempt) -> float | None:
        """Seconds until the slowest running rank counts as hung; None without a watchdog."""
        timeout = self.failure_config.hang_timeout_s
        if timeout is None or (oldest := att.least_recently_heard()) is None:
            return None
        return max(0.0, oldest + timeout - self.clock.monotonic())

    def _hung(self, s: GroupState) -> GroupFailed:
        """No report from some rank within hang_timeout_s. The hung rank is the one furthest
        behind; the others usually wait for it in a collective (and one that already failed
        waiting for a peer is not the hung one). Every rank of the group is a candidate, also
        one whose "started" message has not arrived (one that froze early may never send it)."""
        att = s.attempt
        waiting = att.suspect.rank if att.suspect is not None else None
        ranks = range(len(att.group.addresses))
        rank = hung_rank(ranks, att.done, waiting, att.rounds.received, att.progress)
        assert rank is not None  # the watchdog fires only while some rank runs
        timeout = self.failure_config.hang_timeout_s
        error = f"no report() for {timeout:g}s (failure_config.hang_timeout_s)"
        return GroupFailed(s, rank, FailureKind.HANG, error)

    # -- preemption --------------------------------------------------------------------------------

    def _noted(
        self, s: GroupState, workers: set[str], deadline: float, boundary: bool
    ) -> Preempting:
        """Workers of the group were told to leave by `deadline` (epoch seconds); `boundary`:
        the ranks learned it at a report (and save a just-in-time checkpoint)."""
        if isinstance(s, Preempting):
            s.workers |= workers
            s.deadline = min(s.deadline, deadline)
            s.boundary |= boundary
            return s
        self.log(f"workers {sorted(workers)} were told to leave by {deadline:.0f} (epoch s)")
        return Preempting(s.attempt, set(workers), deadline, boundary)
