"""The controller's transitions, one at a time, with a fake cluster (tests/fake_cluster.py): no
Dask, no torch. The run state, its store and the checkpoint manager are the real ones, on a
local directory. The test plays the ranks by putting their events on the controller's queue.
Time is a fake clock's (tests/fake_clock.py): it moves only when the controller would wait, so
every deadline here is the real knob's, and no test waits for one."""

from __future__ import annotations

import pytest

import ft_train
from ft_train import knobs
from ft_train.controller import (
    Callback,
    Controller,
    Draining,
    Errored,
    Finished,
    Preempting,
    Resizing,
    Restarting,
    Running,
)
from ft_train.errors import AttemptFailed, RunLockedError, SessionError, TrainingFailedError
from ft_train.protocol import Report, Reported
from ft_train.snapshots.piece import SnapshotPiece
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore
from tests.fake_clock import FakeClock
from tests.fake_cluster import FakeCluster, fake_plan

pytestmark = pytest.mark.timeout(10)


class Recorder(Callback):
    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def on_attempt_started(self, attempt):
        self.calls.append(("attempt", attempt.attempt))

    def on_checkpoint_committed(self, entry, state):
        self.calls.append(("checkpoint", entry.report_index))

    def on_failure(self, failure):
        self.calls.append(("failure", failure.kind))

    def on_run_end(self, state):
        self.calls.append(("end", state.status))


@pytest.fixture
def make(tmp_path):
    def make(workers=3, ranks=2, **failure) -> tuple[Controller, FakeCluster, Recorder]:
        storage = Storage(str(tmp_path / "runs"))
        store = RunStore(storage, "run")
        state = RunState(name="run")
        cfg = ft_train.CheckpointConfig(**failure.pop("checkpoint", {}))
        plan = fake_plan(storage, ranks=ranks, min_workers=failure.pop("min_workers", None))
        cluster, recorder = FakeCluster(workers), Recorder()
        failure.setdefault("hang_timeout_s", None)
        ctl = Controller(
            cluster,
            plan,
            state,
            store,
            CheckpointManager(storage, store, cfg),
            ft_train.FailureConfig(**failure),
            log=lambda msg: None,
            callbacks=[recorder],
            clock=FakeClock(),
        )
        return ctl, cluster, recorder

    return make


def go(ctl: Controller, steps: int = 1):
    """Make `steps` transitions; the last state."""
    for _ in range(steps):
        ctl.step()
    return ctl.current


def started(ctl: Controller):
    go(ctl)
    assert isinstance(ctl.current, Running)
    return ctl.cluster.group


# -- starting, rounds, commits, finishing ------------------------------------------------------


def test_a_start_records_the_attempt_and_watches_for_preemption(make):
    ctl, cluster, rec = make()
    group = started(ctl)
    assert group.addresses == cluster.workers[:2] and group.started_from == (None, 0)
    assert ctl.state.status == "running" and ctl.state.attempts[0].world_size == 2
    assert cluster.watching == [ctl.failure_config.preemption_notice_s]
    assert rec.calls == [("attempt", 0)]


def test_when_every_rank_has_joined_the_workers_warm_up(make):
    ctl, cluster, _ = make()
    started(ctl).joined()
    go(ctl, 2)
    assert cluster.warmed and ctl.start_failures == 0


def test_a_round_completes_only_once_every_rank_reported_it(make):
    ctl, _, _ = make()
    group = started(ctl)
    group.report(1, ranks=[0], checkpoint=True)
    go(ctl)
    assert ctl.state.latest is None
    group.report(1, ranks=[1], checkpoint=True)
    go(ctl, 2)  # the report, then the round
    assert ctl.state.latest.startswith("checkpoint_000001") and ctl.state.report_index == 1


def test_a_committed_checkpoint_ends_the_segment(make):
    ctl, _, rec = make()
    started(ctl).report(1).report(2, checkpoint=True, loss=0.5)
    segment = ctl.run_segment()
    assert (segment.kind, segment.report_index, segment.metrics["loss"]) == ("checkpoint", 2, 0.5)
    assert ("checkpoint", 2) in rec.calls


def test_a_checkpoint_without_a_file_on_any_rank_ends_the_run(make):
    ctl, _, _ = make(max_failures=3)
    group = started(ctl)
    group.report(1)
    for rank in range(2):  # each rank attached an empty directory
        group.events.put(Reported(group.attempt, Report(rank, 2, {}, "checkpoint_000002-a0-x", {})))
    with pytest.raises(SessionError, match="holds no files on any rank"):
        ctl.run_segment()
    assert ctl.state.latest is None and ctl.state.status == "failed"


def test_ranks_that_return_alike_drain_their_last_reports_then_finish(make):
    ctl, _, rec = make()
    group = started(ctl).report(1, checkpoint=True)
    group.returned(reports=2)
    assert ctl.run_segment().kind == "checkpoint"
    go(ctl, 2)  # the two returns
    assert isinstance(go(ctl), Draining)
    group.report(2)
    go(ctl, 2)  # the two reports arrive
    assert isinstance(go(ctl, 2), Finished)  # the round, then the end
    assert ctl.state.status == "finished" and group.released
    assert rec.calls[-1] == ("end", "finished")


def test_ranks_that_reported_unequally_end_the_run_at_once(make):
    ctl, _, _ = make(max_failures=5)
    group = started(ctl)
    group.returned(reports=2, ranks=[0]).returned(reports=3, ranks=[1])
    with pytest.raises(SessionError, match="different number of times"):
        ctl.run_segment()
    assert ctl.state.status == "failed" and not ctl.state.failures


def test_reports_that_never_arrive_after_the_ranks_returned_fail_the_group(make):
    ctl, _, _ = make(max_failures=1)
    started(ctl).returned(reports=3)
    began = ctl.clock.monotonic()
    with pytest.raises(AttemptFailed, match="never reached the driver"):
        ctl.run_segment()
    assert ctl.state.failures[-1].kind == "exception"
    assert ctl.clock.monotonic() - began == knobs.REPORT_DRAIN_TIMEOUT_S


# -- failures and what they are charged to ------------------------------------------------------


def test_a_rank_that_raised_is_charged_and_its_worker_killed_first(make):
    ctl, _, rec = make(max_failures=1)
    group = started(ctl).raised(1, "ValueError: boom", step=3)
    with pytest.raises(AttemptFailed, match="rank 1 failed"):
        ctl.run_segment()
    assert isinstance(ctl.current, Restarting)
    (failure,) = ctl.state.failures
    assert (failure.kind, failure.rank, failure.step, failure.charged) == ("exception", 1, 3, True)
    assert group.killed == {group.addresses[1]} and group.stopped
    assert ("failure", "exception") in rec.calls


def test_a_restart_after_a_failure_starts_from_the_latest_checkpoint(make):
    ctl, cluster, _ = make(max_failures=1)
    group = started(ctl).report(1, checkpoint=True)
    ctl.run_segment()
    group.raised(0, "boom", step=1)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    nxt = started(ctl)
    assert nxt.attempt == 1 and nxt.started_from == (ctl.state.latest, 1)
    assert group.addresses[0] not in nxt.addresses  # the killed worker is not used again


def test_a_broken_contract_ends_the_run_without_a_retry(make):
    ctl, _, _ = make(max_failures=3)
    started(ctl).raised(0, "SessionError: metrics must be JSON-serialisable", step=1, fatal=True)
    with pytest.raises(SessionError, match="JSON"):
        ctl.run_segment()
    assert ctl.state.status == "failed" and ctl.state.charged_failures == 0


def test_a_peer_that_lost_its_connection_waits_for_the_cause(make):
    ctl, cluster, _ = make(max_failures=1)
    group = started(ctl).raised(0, "RuntimeError: Connection closed by peer", step=4)
    assert isinstance(go(ctl), Running) and ctl.current.attempt.suspect.rank == 0
    cluster.lost_kinds[group.addresses[1]] = "process_death"
    group.lost(1)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    failure = ctl.state.failures[-1]
    assert (failure.kind, failure.rank) == ("process_death", 1)


def test_a_suspect_with_no_cause_in_sight_is_charged_itself(make):
    ctl, _, _ = make(max_failures=1)
    started(ctl).raised(0, "RuntimeError: Connection reset by peer", step=4)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    assert (ctl.state.failures[-1].kind, ctl.state.failures[-1].rank) == ("exception", 0)


def test_a_collective_that_timed_out_blames_the_rank_it_waited_for(make):
    ctl, _, _ = make(max_failures=1)
    group = started(ctl).report(1).report(2, ranks=[0]).report(3, ranks=[0])
    group.raised(0, "RuntimeError: Timed out waiting for recv", step=3)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    failure = ctl.state.failures[-1]
    assert (failure.kind, failure.rank, failure.step) == ("hang", 1, 1)


def test_a_worker_the_scheduler_dropped_silently_is_found_when_its_peer_is_judged(make):
    ctl, cluster, _ = make(max_failures=1)
    group = started(ctl).raised(0, "RuntimeError: Connection closed by peer", step=2)
    cluster.workers.remove(group.addresses[1])  # gone, with no event yet
    cluster.lost_kinds[group.addresses[1]] = "node_loss"
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    failure = ctl.state.failures[-1]
    assert (failure.kind, failure.rank) == ("node_loss", 1)
    assert group.journal_skips[-1] == {group.addresses[1]}  # its node's journals are gone too


@pytest.mark.parametrize(
    "how, kind",
    [
        ({"cancelled": True}, "node_loss"),
        ({"error": OSError("gone"), "worker_died": True}, "process_death"),
        ({"error": OSError("odd")}, "process_death"),
    ],
)
def test_a_rank_task_that_ended_without_raising_itself_is_charged_by_how(make, how, kind):
    ctl, _, _ = make(max_failures=1)
    started(ctl).ended(1, **how)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    assert (ctl.state.failures[-1].kind, ctl.state.failures[-1].rank) == (kind, 1)


def test_a_rank_silent_past_the_watchdog_is_hung(make):
    ctl, _, _ = make(max_failures=1, hang_timeout_s=0.05)
    started(ctl).joined().report(1).report(2, ranks=[0])
    with pytest.raises(AttemptFailed, match="hang"):
        ctl.run_segment()
    failure = ctl.state.failures[-1]
    assert (failure.kind, failure.rank, failure.step) == ("hang", 1, 1)


def test_the_watchdog_counts_from_the_rank_heard_from_least_recently(make):
    """Not from the rank heard from first: the controller keeps its ranks in the order heard
    (`Attempt.heard`), so that it need not look at every rank at every event."""
    ctl, _, _ = make(max_failures=1, hang_timeout_s=1.0)
    group = started(ctl).joined(0, 1)
    go(ctl, 2)
    ctl.clock.advance(0.7)
    group.report(1, ranks=[0])  # rank 0, heard from first, is heard from again
    go(ctl)
    began = ctl.clock.monotonic()
    with pytest.raises(AttemptFailed, match="hang"):
        ctl.run_segment()
    assert ctl.state.failures[-1].rank == 1
    # rank 1's 1 s ran out 0.3 s after rank 0's report (counted from rank 0, 1 s after it)
    assert ctl.clock.monotonic() - began == pytest.approx(0.3)


def test_the_budget_spent_ends_the_run_naming_the_setting(make):
    ctl, _, rec = make(max_failures=1)
    started(ctl).raised(0, "boom", step=1)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    started(ctl).raised(1, "boom again", step=1)
    with pytest.raises(TrainingFailedError, match="max_failures=1"):
        ctl.run_segment()
    assert isinstance(ctl.current, Errored) and ctl.state.status == "failed"
    assert rec.calls[-1] == ("end", "failed")


def test_unlimited_failures_keep_restarting(make):
    ctl, _, _ = make(max_failures=-1, workers=30)
    for _ in range(10):
        started(ctl).joined().raised(0, "boom", step=0)
        with pytest.raises(AttemptFailed):
            ctl.run_segment()
    assert ctl.state.charged_failures == 10


def test_groups_that_keep_failing_before_their_ranks_join_end_the_run(make):
    ctl, _, _ = make(max_failures=-1, workers=30)
    for _ in range(2):
        started(ctl).raised(0, "rendezvous failed", step=0)
        with pytest.raises(AttemptFailed):
            ctl.run_segment()
    started(ctl).raised(0, "rendezvous failed", step=0)
    with pytest.raises(TrainingFailedError, match="failed to start 3 times in a row"):
        ctl.run_segment()


def test_ranks_that_joined_by_their_journals_do_not_count_as_a_failed_start(make):
    ctl, cluster, _ = make(max_failures=-1, workers=30)
    for _ in range(4):
        group = started(ctl)
        group.journals = {
            r: {"index": 0, "at": 1.0, "messages": []} for r in (0, 1)
        }  # as journal.collect reads them
        group.raised(0, "boom", step=0)  # their "started" never reached the driver
        with pytest.raises(AttemptFailed):
            ctl.run_segment()
    assert ctl.start_failures == 0 and ctl.state.charged_failures == 4


def held(attempt_id: str, rank: int, index: int) -> SnapshotPiece:
    """A holder's answer for one copy of a rank's snapshot piece."""
    return SnapshotPiece(attempt_id, rank, index, "snapshot", 2, 1, holder=f"tcp://n{rank}:1")


@pytest.mark.parametrize("lost_while_placing", [False, True])
def test_the_snapshot_round_is_chosen_once_the_restarts_workers_are_placed(
    make, lost_while_placing
):
    """A holder lost while the restart waits for its workers is not chosen: the round to restore
    is chosen after the workers are placed, not before (a rank would fetch from a dead holder)."""
    ctl, cluster, _ = make(max_failures=1)
    group = started(ctl)
    cluster.snapshots = [held(group.attempt_id, rank, 5) for rank in (0, 1)]
    group.raised(0, "boom", step=6)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    if lost_while_placing:
        cluster.while_placing = lambda: cluster.snapshots.pop()  # rank 1's only copy
    nxt = started(ctl)
    if lost_while_placing:
        assert nxt.snapshot is None and nxt.started_from == (None, 0)
    else:
        assert nxt.snapshot is not None and nxt.started_from == (None, 5)


# -- what the journals keep -------------------------------------------------------------------


def test_a_round_whose_last_report_died_with_its_rank_is_committed_from_the_journal(make):
    ctl, _, _ = make(max_failures=1)
    group = started(ctl).report(4, ranks=[0], checkpoint=True)
    # rank 1 returned from report 4 (no files) and was killed with it still queued
    group.journals = {1: {"index": 4, "at": 1.0, "messages": []}}
    group.lost(1)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    assert ctl.state.report_index == 4 and ctl.state.latest.startswith("checkpoint_000004")
    assert ctl.state.failures[-1].step == 4  # the failure's step is exact too
    assert started(ctl).started_from == (ctl.state.latest, 4)


def test_an_async_upload_that_never_finished_leaves_its_round_uncommitted(make):
    ctl, _, _ = make(max_failures=1)
    group = started(ctl).report(4, ranks=[0], checkpoint=True)
    intent = {"rank": 1, "index": 4, "dir_name": "checkpoint_000004-a0-x", "upload": "pending"}
    group.journals = {1: {"index": 4, "at": 1.0, "messages": [intent]}}
    group.lost(1)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    assert ctl.state.latest is None


# -- preemption, damaged checkpoints, resizing, the lease --------------------------------------


def test_a_notice_then_a_just_in_time_checkpoint_restarts_elsewhere_uncharged(make):
    ctl, _, _ = make()
    group = started(ctl).notice(1, deadline=ctl.clock.time() + 60)
    assert isinstance(go(ctl), Preempting)
    group.preempted_at(1, leaving=(1,), deadline=ctl.clock.time() + 60, checkpoint=True)
    segment = ctl.run_segment()  # the JIT checkpoint ends the segment; no error
    assert segment.kind == "checkpoint" and isinstance(ctl.current, Restarting)
    failure = ctl.state.failures[-1]
    assert (failure.kind, failure.charged) == ("preemption", False)
    assert group.addresses[1] in ctl.dead_workers
    assert group.addresses[1] not in started(ctl).addresses


def test_a_notice_that_runs_out_without_a_checkpoint_restarts_at_once(make):
    ctl, _, _ = make(workers=4)
    started(ctl).notice(0, deadline=ctl.clock.time() - 1)
    go(ctl)
    assert isinstance(go(ctl), Restarting)  # the deadline has passed
    assert "no checkpoint was saved in time" in ctl.state.failures[-1].error
    assert isinstance(go(ctl), Running)


def test_a_retired_worker_gives_its_ranks_notice(make):
    ctl, _, _ = make()
    group = started(ctl).lost(0, expected=True)
    assert isinstance(go(ctl), Preempting)
    assert [a for a, _ in group.notices] == [group.addresses[0]]


def test_a_damaged_latest_checkpoint_is_dropped_and_the_one_before_restored(make):
    ctl, _, _ = make(max_failures=0)
    group = started(ctl).report(1, checkpoint=True)
    ctl.run_segment()
    group.report(2, checkpoint=True)
    ctl.run_segment()
    damaged, kept = ctl.state.latest, ctl.state.checkpoints[0].dir_name
    group.raised(
        0,
        "CheckpointDamagedError: sha256 differs",
        step=2,
        damaged=ctl.manager.latest_uri(ctl.state),
    )
    go(ctl)
    assert isinstance(ctl.current, Restarting) and ctl.state.latest == kept
    assert damaged not in [c.dir_name for c in ctl.state.checkpoints]
    assert not ctl.state.failures[-1].charged


def test_a_damaged_latest_checkpoint_with_none_before_it_is_a_charged_failure(make):
    ctl, _, _ = make(max_failures=1, checkpoint={"num_to_keep": 1})
    group = started(ctl).report(1, checkpoint=True)
    ctl.run_segment()
    latest = ctl.state.latest
    damaged = ctl.manager.latest_uri(ctl.state)
    group.raised(0, "CheckpointDamagedError: sha256 differs", step=1, damaged=damaged)
    with pytest.raises(AttemptFailed, match="no earlier checkpoint is kept"):
        ctl.run_segment()
    assert ctl.state.latest == latest and ctl.state.failures[-1].charged


def test_an_unusable_snapshot_round_is_passed_over_uncharged(make):
    ctl, cluster, _ = make(max_failures=1, workers=6)
    group = started(ctl)
    cluster.snapshots = [held(group.attempt_id, rank, 5) for rank in (0, 1)]
    group.raised(0, "boom", step=6)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    restored = started(ctl)
    assert restored.snapshot is not None and restored.started_from == (None, 5)
    restored.raised(
        1, "SnapshotError: piece gone", step=5, damaged=f"snapshot://{group.attempt_id}/5"
    )
    go(ctl)
    assert isinstance(ctl.current, Restarting) and not ctl.state.failures[-1].charged
    assert "from an older snapshot or from storage" in ctl.state.failures[-1].error
    assert started(ctl).snapshot is None  # the round is not taken again


def test_an_elastic_group_with_workers_to_spare_resizes_after_a_checkpoint(make):
    ctl, cluster, _ = make(ranks=3, min_workers=2, workers=2)
    group = started(ctl).report(1, checkpoint=True)
    cluster.workers.append("tcp://w9:1")
    cluster.grow = True
    ctl.run_segment()
    assert isinstance(ctl.current, Resizing) and group.stop_requested
    group.returned(reports=1, stopped=True)
    go(ctl, 3)
    assert isinstance(ctl.current, Restarting) and ctl.current.failure is None
    assert len(started(ctl).addresses) == 3


def test_a_lost_lease_stops_the_ranks_and_writes_nothing(make):
    ctl, _, _ = make()
    group = started(ctl)
    ctl.lease_lost("taken over by another driver")
    with pytest.raises(RunLockedError):
        ctl.run_segment()
    assert group.stopped and ctl.state.status == "running"


def test_events_of_a_stopped_group_are_ignored(make):
    ctl, cluster, _ = make(max_failures=1, workers=4)
    old = started(ctl).raised(0, "boom", step=0)
    with pytest.raises(AttemptFailed):
        ctl.run_segment()
    started(ctl)
    old.raised(1, "late", step=0)
    assert isinstance(go(ctl), Running) and len(ctl.state.failures) == 1


def test_a_ctrl_c_is_recorded_uncharged_and_stops_the_ranks(make):
    ctl, _, rec = make()
    group = started(ctl)
    ctl.abort(KeyboardInterrupt())
    assert group.stopped and isinstance(ctl.current, Errored)
    assert ctl.state.status == "interrupted"
    assert (ctl.state.failures[-1].kind, ctl.state.failures[-1].charged) == (
        "driver_interrupt",
        False,
    )
    assert ("failure", "driver_interrupt") in rec.calls
