"""A running group's transitions: what the controller does with its events and deadlines.

Each function takes the controller and the current state (Running, Resizing or Preempting) and
returns the next state. The decisions are `ft_train.policy`'s; the controller executes them.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

from .. import knobs
from ..errors import RankFailure, RunLockedError, SessionError
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
from ..storage.run_state import FailureRecord
from ..wording import after_report, plural
from .rounds import Round
from .state import Attempt, GroupState, Preempting, Resizing, Restarting, Running, State, Suspect

logger = logging.getLogger("ft_train")

if TYPE_CHECKING:
    from .controller import Controller


def watch(ctl: Controller, s: GroupState) -> State:
    """The next complete round, the end of every rank, an event, or a deadline."""
    att = s.attempt
    if (rnd := att.rounds.pop_complete()) is not None:
        return _on_round(ctl, s, rnd)
    if len(att.done) == len(att.group.addresses):
        if any(d.get("stopped") for d in att.done.values()):
            return preempted(ctl, s, None) if isinstance(s, Preempting) else _resized(ctl, att)
        return ctl.drain(s)
    try:
        event = ctl.events.get(timeout=_next_deadline(ctl, s))
    except queue.Empty:
        return _on_deadline(ctl, s)
    return _on_event(ctl, s, event)


def _on_round(ctl: Controller, s: GroupState, rnd: Round) -> State:
    group = s.attempt.group
    if rnd.preempted is not None:
        leaving = {group.addresses[r] for r in rnd.preempted}
        s = _noted(ctl, s, leaving, rnd.deadline or time.time(), boundary=True)
    after = ctl._on_round(s, rnd)
    if rnd.dir_name is None or after is not s:  # no checkpoint, or one the run cannot take
        return after
    if isinstance(s, Preempting) and s.boundary:
        return preempted(ctl, s, rnd.dir_name)
    if isinstance(s, Running) and ctl.cluster.can_grow(ctl.plan, group.addresses, ctl.dead_workers):
        # An elastic group below max_workers, and workers to spare: stop it at the next report
        # (a resize, not a failure) and start a larger one from this checkpoint.
        group.request_stop()
        return Resizing(s.attempt)
    return s


def _on_event(ctl: Controller, s: GroupState, event: GroupEvent) -> State:
    if isinstance(event, LeaseLost):
        return ctl.errored(RunLockedError(event.why), record=False)
    att = s.attempt
    if event.attempt != att.group.attempt:
        return s  # a late event from a group already stopped
    if isinstance(event, Reported):
        att.heard(event.message.rank)
        if isinstance(event.message, Report):
            att.rounds.add(event.message)
        elif isinstance(event.message, Started) and len(att.progress) == len(att.group.addresses):
            ctl.start_failures = 0  # every rank started: the group is up
            ctl._warm_workers()
        return s
    if isinstance(event, PreemptNotice):
        if event.address not in att.group.addresses:
            return s
        return _noted(ctl, s, {event.address}, event.deadline, boundary=False)
    if isinstance(event, WorkerLost):
        return _on_lost(ctl, s, event)
    if isinstance(event, RankEnded):
        return _on_ended(ctl, s, event)
    return s


def _on_lost(ctl: Controller, s: GroupState, event: WorkerLost) -> State:
    if isinstance(s, Preempting) and event.address in s.workers:
        return preempted(ctl, s, None)  # it left before a checkpoint
    if event.expected:
        # Retired on purpose (Client.retire_workers): the scheduler has let it go, but its
        # process stays while its rank runs. Give the ranks notice, as SIGTERM would.
        deadline = time.time() + ctl.failure_config.preemption_notice_s
        s.attempt.group.give_notice(event.address, deadline)
        return _noted(ctl, s, {event.address}, deadline, boundary=False)
    return _lost(ctl, s, event.address)


def _lost(ctl: Controller, s: GroupState, address: str) -> State:
    """The scheduler let a rank's worker go: fail the group."""
    group = s.attempt.group
    kind = group.lost_kind(address)
    what = "process died" if kind == "process_death" else "node left the cluster"
    return ctl.fail(s, group.addresses.index(address), kind, f"worker {address}: {what}")


def _on_ended(ctl: Controller, s: GroupState, event: RankEnded) -> State:
    att, rank, exc = s.attempt, event.rank, event.error
    if event.summary is not None:
        att.done[rank] = event.summary
        return s
    if event.cancelled:
        return ctl.fail(s, rank, "node_loss", "the rank's Dask task was cancelled")
    if isinstance(exc, RankFailure) and exc.fatal:
        att.group.stop(grace_s=0.0)
        ctl.warn(f"rank {rank} broke the training function's contract:\n{exc.traceback}")
        return ctl.errored(SessionError(exc.error.split(": ", 1)[-1]))
    if isinstance(exc, RankFailure):
        if att.suspect is None and lost_a_peer(exc.error):
            # Most likely the echo of another rank's failure, whose own signal (a lost
            # worker, a killed process, a hung peer) may still be on its way: wait for it.
            att.suspect = Suspect(rank, exc, time.monotonic() + knobs.COLLATERAL_WAIT_S)
            return s
        return _rank_raised(ctl, s, rank, exc)
    if event.worker_died:
        return ctl.fail(s, rank, "process_death", "the rank's worker process died")
    return ctl.fail(s, rank, "process_death", f"{type(exc).__name__}: {exc}")


def _rank_raised(ctl: Controller, s: GroupState, rank: int, exc: RankFailure) -> State:
    """Fail the group, unless the rank found the checkpoint it restores from damaged and an
    earlier one is kept: then restart from that one."""
    # One line for what is expected of a fault-tolerant run; the traceback at DEBUG, and kept
    # in the failure's record (`ft-train status --json`, the UI's failures table).
    ctl.warn(f"rank {rank} raised {after_report(exc.step)}: {_first_line(exc.error)}")
    logger.debug("rank %d raised %s:\n%s", rank, after_report(exc.step), exc.traceback)
    if exc.damaged is not None and ctl.snapshots.unusable(exc.damaged):
        return _snapshot_unusable(ctl, s, rank, exc)
    state = ctl.state
    if exc.damaged is None or exc.damaged != ctl.manager.latest_uri(state):
        return ctl.fail(s, rank, "exception", exc.error, step=exc.step, traceback=exc.traceback)
    earlier = [c for c in state.checkpoints if c.dir_name != state.latest]
    if not earlier:  # nothing to fall back to: a failure like any other
        return ctl.fail(
            s,
            rank,
            "exception",
            f"{exc.error}; no earlier checkpoint is kept (raise "
            "run_config.checkpoint_config.num_to_keep to keep one)",
            step=exc.step,
            traceback=exc.traceback,
        )
    return _fall_back(ctl, s, rank, exc, earlier)


def _snapshot_unusable(ctl: Controller, s: GroupState, rank: int, exc: RankFailure) -> State:
    """A piece of the snapshot round the group restored from was gone or damaged when a rank
    fetched it: restart from the next newest round, or storage; not charged (the tier is a bonus
    above storage, and each round is given up once, so this cannot loop)."""
    ctl.dead_workers |= s.attempt.group.stop(grace_s=ctl.stop_grace_s)
    return ctl.judge(
        FailureRecord(
            kind="exception",
            rank=rank,
            step=exc.step,
            error=f"{exc.error}; the run goes on from an older snapshot or from storage",
            attempt=s.attempt.group.attempt,
            charged=False,
        )
    )


def _fall_back(ctl: Controller, s: GroupState, rank: int, exc: RankFailure, earlier: list) -> State:
    """The latest checkpoint is damaged (its files do not match its manifest): no restart
    from it can succeed. Drop it from the run, so that the next group restores from the
    checkpoint before it, and record a failure not charged to max_failures (each damaged
    checkpoint is dropped once, so this cannot loop). Its directory, no longer referenced, is
    left to the orphan sweep. Its group restored nothing, so no round of it is recovered."""
    state, group, damaged = ctl.state, s.attempt.group, ctl.state.latest
    previous = max(earlier, key=lambda c: c.report_index)
    ctl.dead_workers |= group.stop(grace_s=ctl.stop_grace_s)
    state.checkpoints = earlier
    state.latest, state.report_index = previous.dir_name, previous.report_index
    ctl.warn(
        f"checkpoint {damaged} is damaged ({exc.error}); restoring from "
        f"{previous.dir_name} (report {previous.report_index})"
    )
    return ctl.judge(
        FailureRecord(
            kind="exception",
            rank=rank,
            step=exc.step,
            error=f"{exc.error}; checkpoint {damaged} dropped, the run goes on from "
            f"{previous.dir_name} (report {previous.report_index})",
            attempt=group.attempt,
            charged=False,
        )
    )


# -- deadlines -------------------------------------------------------------------------------


def _next_deadline(ctl: Controller, s: GroupState) -> float | None:
    """Seconds until the controller must act without an event: a watchdog or a judgement."""
    att = s.attempt
    waits = [_watchdog_remaining(ctl, att)]
    if att.suspect is not None:
        waits.append(max(0.0, att.suspect.deadline - time.monotonic()))
    if isinstance(s, Preempting):
        waits.append(max(0.0, s.deadline + knobs.NOTICE_SLACK_S - time.time()))
    return min((w for w in waits if w is not None), default=None)


def _on_deadline(ctl: Controller, s: GroupState) -> State:
    att = s.attempt
    if isinstance(s, Preempting) and time.time() >= s.deadline + knobs.NOTICE_SLACK_S:
        return preempted(ctl, s, None)  # the notice ran out
    if att.suspect is not None and time.monotonic() >= att.suspect.deadline:
        return _judge_suspect(ctl, s, att.suspect)
    if (remaining := _watchdog_remaining(ctl, att)) is not None and remaining <= 0:
        return _hung(ctl, s)
    return s


def _judge_suspect(ctl: Controller, s: GroupState, suspect: Suspect) -> State:
    att, exc = s.attempt, suspect.failure
    ranks = range(len(att.group.addresses))
    gone = None
    if not isinstance(s, Preempting):
        # The group's workers the scheduler no longer lists. Should the lost event of one come
        # later than knobs.COLLATERAL_WAIT_S after a peer's error (a loaded machine), a rank that only
        # lost that peer would be blamed without this look, and its healthy worker killed.
        alive = ctl.cluster.alive()
        gone = next((r for r in ranks if att.group.addresses[r] not in alive), None)
    lagging = laggard(ranks, att.done, suspect.rank, exc.step, att.rounds.received)
    blame = judge_suspect(suspect.rank, exc.error, isinstance(s, Preempting), gone, lagging)
    if blame.kind == "preemption" and isinstance(s, Preempting):  # it lost a peer that was leaving
        return preempted(ctl, s, None)
    if blame.kind == "lost" and blame.rank is not None:
        return _lost(ctl, s, att.group.addresses[blame.rank])
    if blame.kind == "hang" and blame.rank is not None:
        # A collective timed out waiting for a rank that stopped making progress.
        return ctl.fail(s, blame.rank, "hang", blame.error)
    return _rank_raised(ctl, s, suspect.rank, exc)


def _watchdog_remaining(ctl: Controller, att: Attempt) -> float | None:
    """Seconds until the slowest running rank counts as hung; None without a watchdog."""
    timeout = ctl.failure_config.hang_timeout_s
    if timeout is None or (oldest := att.least_recently_heard()) is None:
        return None
    return max(0.0, oldest + timeout - time.monotonic())


def _hung(ctl: Controller, s: GroupState) -> State:
    """No report from some rank within hang_timeout_s. The hung rank is the one furthest
    behind; the others usually wait for it in a collective (and one that already failed
    waiting for a peer is not the hung one). Every rank of the group is a candidate, also one
    whose "started" message has not arrived (one that froze early may never send it)."""
    att = s.attempt
    waiting = att.suspect.rank if att.suspect is not None else None
    ranks = range(len(att.group.addresses))
    rank = hung_rank(ranks, att.done, waiting, att.rounds.received, att.progress)
    assert rank is not None  # the watchdog fires only while some rank runs
    timeout = ctl.failure_config.hang_timeout_s
    return ctl.fail(
        s, rank, "hang", f"no report() for {timeout:g}s (failure_config.hang_timeout_s)"
    )


# -- preemption and resizing -----------------------------------------------------------------


def _noted(
    ctl: Controller, s: GroupState, workers: set[str], deadline: float, boundary: bool
) -> Preempting:
    if isinstance(s, Preempting):
        s.workers |= workers
        s.deadline = min(s.deadline, deadline)
        s.boundary |= boundary
        return s
    ctl.log(f"workers {sorted(workers)} were told to leave by {deadline:.0f} (epoch s)")
    return Preempting(s.attempt, set(workers), deadline, boundary)


def preempted(ctl: Controller, s: Preempting, jit: str | None) -> State:
    """Workers are leaving: stop the group, let them go, record a preemption (charged to
    max_preemption_failures only) and restart; the next group starts from the latest
    committed checkpoint, which is the just-in-time one (`jit`) when the loop saved it."""
    group, leaving = s.attempt.group, s.workers
    # They go now rather than at their deadline; the other ranks then fail on their own at
    # once (gloo sees the closed connections) and keep their processes.
    ctl.stop_group(s.attempt, kill_first=leaving)
    ctl.dead_workers |= leaving
    step = s.attempt.rounds.last_index
    ranks = [group.addresses.index(a) for a in leaving if a in group.addresses]
    what = f"saved {jit} in time" if jit else "no checkpoint was saved in time"
    ctl.log(f"ranks {ranks} preempted {after_report(step)}: {what}; restarting elsewhere")
    return ctl.judge(
        FailureRecord(
            kind="preemption",
            rank=min(ranks, default=None),
            step=step,
            error=f"worker(s) {sorted(leaving)} told to leave; {what}",
            attempt=group.attempt,
            charged=False,
        )
    )


def _resized(ctl: Controller, att: Attempt) -> State:
    """The ranks left their training function at the driver's request: start a larger group
    from the latest committed checkpoint."""
    att.group.release()
    # the ranks' last reports may still be on their way: their journals have them
    if (rnd := att.rounds.recover(att.group.read_journals())) is not None:
        ctl._commit(rnd, " (recovered from the ranks' journals)")
    ctl.log(
        f"growing the group of {plural(len(att.group.addresses), 'rank')} (a resize, not a failure)"
    )
    return Restarting()


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
