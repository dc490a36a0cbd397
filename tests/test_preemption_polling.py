"""get_preemption_info() polled between reports, and ft_train.collective, on two gloo ranks.

First at the session level (two spawned processes, a real gloo group, the notice set as a
worker's SIGTERM handler sets it), then through the flow on a Dask cluster whose worker is
retired mid-run (`Client.retire_workers`) while the loop reports only at the notice and at a
rare periodic checkpoint."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time

import pytest
from distributed import Client

import ft_train
from ft_train.compat.torch_distributed import control_group
from ft_train.knobs import AGREE_EVERY_MAX
from ft_train.storage.fs import Storage
from ft_train.worker import preemption
from ft_train.worker import session as session_module
from ft_train.worker.rank import free_port
from ft_train.worker.session import Session
from tests.external_clusters import ExternalCluster
from tests.helpers import load_state, wait_for
from tests.rank_specs import rank_spec

# -- two ranks in two processes ------------------------------------------------------------------


def _polling_rank(rank: int, port: int, script: str, interval_s: float, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    msgs: list = []
    spec = rank_spec(
        Storage(tempfile.mkdtemp()),
        rank,
        2,
        collective_timeout_s=1800.0,
        agreement_interval_s=interval_s,
    )
    session = Session(spec, msgs.append)
    session.control = control_group()
    session_module.install(session)
    seen: dict = {"rank": rank}
    try:
        SCRIPTS[script](session, rank, seen)
        session.finish()
        seen["finished"] = True
    except ft_train.SessionError as e:
        seen["error"] = str(e)
    except preemption.GroupStop:  # what run_rank turns into a stopped rank
        seen["stopped"] = True
    except Exception as e:  # what a broken broadcast raises on rank 0
        seen["raised"] = f"{type(e).__name__}: {e}"
    session_module.install(None)
    seen["preempted_msgs"] = [m.index for m in msgs if m.preempted is not None]
    seen["agreements"], seen["points"] = session.agreements, session.points
    out.put(seen)
    dist.destroy_process_group()


def _polled(session: Session, rank: int, seen: dict) -> None:
    """Ray's pattern: poll every step (~1 ms), report only at the notice (once) and at a
    periodic checkpoint every 30 steps. Rank 1's worker has notice from step 40."""
    for step in range(1, 301):
        if step == 40 and rank == 1:
            preemption._deadline = time.time() + 60  # what its SIGTERM handler sets
        time.sleep(0.001)  # the step's compute
        info = ft_train.get_preemption_info()
        if info is not None and "learned_at" not in seen:
            seen["learned_at"], seen["ranks"] = step, info.preempted_ranks
            seen["reported_before"] = info.reported
        if info is not None and not info.reported:
            session.report({"step": step})  # the just-in-time report
            seen["jit_report"] = session.report_index
            seen["reported_after"] = ft_train.get_preemption_info().reported
        elif step % 30 == 0:
            session.report({"step": step})


def _return_at_the_notice(session: Session, rank: int, seen: dict) -> None:
    """A report every 5 steps, a poll every step; the loop returns as soon as it is told
    (it counts its last periodic checkpoint as saved), without another report."""
    for step in range(1, 101):
        if step == 12 and rank == 1:
            preemption._deadline = time.time() + 60
        if step % 5 == 0:
            session.report({"step": step})
        if ft_train.get_preemption_info() is not None:
            seen["returned_at"] = step
            return


def _unequal_polls(session: Session, rank: int, seen: dict) -> None:
    """Rank 1 polls twice a step, rank 0 once; both report every 10 steps."""
    for step in range(1, 101):
        for _ in range(1 + rank):
            ft_train.get_preemption_info()
        if step % 10 == 0:
            session.report({"step": step})


def _one_more_poll_at_the_end(session: Session, rank: int, seen: dict) -> None:
    for step in range(1, 21):
        ft_train.get_preemption_info()
        session.report({"step": step})
    if rank == 1:
        ft_train.get_preemption_info()


def _collectives(session: Session, rank: int, seen: dict) -> None:
    """Barriers and broadcasts between reports, with an agreement pending at each (interval 0)."""
    got = []
    for step in range(1, 6):
        session.report({"step": step})
        ft_train.collective.barrier()
        ft_train.get_preemption_info()
        session.report({"step": step, "half": True})
        data = {"step": step, "from": rank, "blob": "x" * 5000} if rank == 0 else None
        got.append(ft_train.collective.broadcast_from_rank_zero(data))
    seen["got"] = [(d["step"], d["from"], len(d["blob"])) for d in got]
    if rank == 1:
        time.sleep(0.3)  # rank 0 waits for it at the barrier
    started = time.monotonic()
    ft_train.collective.barrier()  # returns once both ranks are there
    seen["barrier_waited_s"] = time.monotonic() - started


def _barrier_against_broadcast(session: Session, rank: int, seen: dict) -> None:
    session.report({"step": 1})
    if rank == 0:
        ft_train.collective.barrier()
    else:
        ft_train.collective.broadcast_from_rank_zero(None)


def _unpicklable_broadcast(session: Session, rank: int, seen: dict) -> None:
    session.report({"step": 1})
    ft_train.collective.broadcast_from_rank_zero(threading.Lock() if rank == 0 else None)


SCRIPTS = {
    "polled": _polled,
    "unequal_polls": _unequal_polls,
    "return_at_the_notice": _return_at_the_notice,
    "one_more_poll_at_the_end": _one_more_poll_at_the_end,
    "collectives": _collectives,
    "barrier_against_broadcast": _barrier_against_broadcast,
    "unpicklable_broadcast": _unpicklable_broadcast,
}


def run_two_ranks(script: str, interval_s: float = 0.0) -> dict[int, dict]:
    """Both ranks' findings; a rank that hangs fails the test at the queue's timeout."""
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_polling_rank, args=(r, port, script, interval_s, out)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {r["rank"]: r for r in results}


def test_a_polled_notice_reaches_every_rank_at_the_same_call_between_reports():
    """agreement_interval_s=0.05 with a poll every ~1 ms: an agreement every ~16 polls. Rank 1's
    notice from step 40 reaches both ranks at the same step, within AGREE_EVERY_MAX + 1 polls,
    with no report in between; the just-in-time report tells the driver, once, and
    `reported` turns True at the same call on both."""
    seen = run_two_ranks("polled", interval_s=0.05)
    learned = seen[0]["learned_at"]
    assert 40 < learned <= 40 + AGREE_EVERY_MAX + 1, seen
    for rank in (0, 1):
        s = seen[rank]
        assert s.get("finished"), seen
        assert (s["learned_at"], s["ranks"]) == (learned, [1]), seen
        assert (s["reported_before"], s["reported_after"]) == (False, True), seen
        assert s["preempted_msgs"] == [s["jit_report"]], seen  # the jit report tells the driver
        assert s["agreements"] <= s["points"] // 4, seen  # not one a poll


def test_returning_at_a_notice_learned_between_reports_leaves_as_a_stopped_group():
    """No report told the driver (the notice came at a poll): the ranks leave as a stopped
    group, which the driver restarts from the latest checkpoint, instead of finishing."""
    seen = run_two_ranks("return_at_the_notice")
    for rank in (0, 1):
        assert seen[rank].get("stopped") and "finished" not in seen[rank], seen
        assert seen[rank]["returned_at"] == 13, seen  # the poll after the one it started at
        assert seen[rank]["preempted_msgs"] == [], seen


def test_ranks_that_poll_a_different_number_of_times_fail_with_a_session_error():
    seen = run_two_ranks("unequal_polls", interval_s=0.0)
    for rank in (0, 1):
        assert "finished" not in seen[rank], seen
        assert "same number of times" in seen[rank]["error"], seen


def test_one_extra_poll_before_returning_fails_both_ranks_when_they_return():
    seen = run_two_ranks("one_more_poll_at_the_end", interval_s=0.05)
    for rank in (0, 1):
        assert "finished" not in seen[rank], seen
        assert "same number of times" in seen[rank]["error"], seen


def test_barrier_and_broadcast_between_reports_keep_the_agreement_in_order():
    seen = run_two_ranks("collectives", interval_s=0.0)
    for rank in (0, 1):
        assert seen[rank].get("finished"), seen
        assert seen[rank]["got"] == [(step, 0, 5000) for step in range(1, 6)], seen
    assert seen[0]["barrier_waited_s"] > 0.15, seen  # for rank 1, 0.3 s late at the last one


def test_a_barrier_met_by_a_broadcast_fails_both_ranks_rather_than_pairing_them():
    seen = run_two_ranks("barrier_against_broadcast")
    for rank in (0, 1):
        assert "another order" in seen[rank]["error"], seen


def test_a_broadcast_that_does_not_pickle_fails_every_rank_without_a_hang():
    seen = run_two_ranks("unpicklable_broadcast")
    assert "pickle" in seen[0]["raised"], seen
    assert "could not be pickled" in seen[1]["error"], seen


# -- through the flow: a worker retired mid-run ------------------------------------------------


def polled_loop(config: dict) -> None:
    """Ray's just-in-time pattern, ported by renaming: poll get_preemption_info() at every
    step, report (with a checkpoint) only when it is not None, once, plus a rare periodic
    checkpoint every `every` steps and at the end. Rank 0 holds at step `hold` until its worker
    has notice (a gate: the test retires the worker then). `step_s`: a step's compute."""
    import torch

    from ft_train.testing.faults import maybe_inject

    rank = ft_train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    step = 0
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        step = state["step"]
    resumed_from, saved = step, False

    def report(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": model.state_dict(), "step": step}, os.path.join(d, "state.pt"))
            attached = ft_train.Checkpoint.from_directory(d) if rank == 0 else None
            ft_train.report(metrics, checkpoint=attached)

    while step < config["steps"]:
        maybe_inject(config["faults"], rank, step)
        if config["step_s"]:
            time.sleep(config["step_s"])
        with torch.no_grad():
            model.weight.add_(0.001)
        step += 1
        metrics = {"step": step, "resumed_from": resumed_from}
        info = ft_train.get_preemption_info()
        if info is not None and not saved:
            report({**metrics, "jit": True})
            saved = True
        elif step % config["every"] == 0 or step == config["steps"]:
            report(metrics)


@pytest.fixture
def cluster(tmp_path):
    c = ExternalCluster(tmp_path)
    try:
        for i in range(3):
            c.add_worker(f"w{i}")
        c.wait_workers(["w0", "w1", "w2"])
        yield c
    finally:
        c.close()


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize(
    "pace",
    [
        {"steps": 400, "every": 100, "hold": 150, "step_s": 0.0},  # a few ms a step
        {"steps": 80, "every": 20, "hold": 30, "step_s": 0.05},  # 50 ms a step
    ],
    ids=["fast", "slow"],
)
@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_a_polled_just_in_time_checkpoint_is_saved_when_a_worker_is_retired(
    storage, tmp_path, cluster, pace
):
    gate = {"rank": 0, "step": pace["hold"], "kind": "until_preempted"}
    gate["marker"] = str(tmp_path / "gate")
    retired_at = []

    def retire_w0():
        wait_for(lambda: os.path.exists(gate["marker"]), 240, "rank 0 to reach the gate")
        with Client(cluster.address, timeout=30) as c:
            retired_at.append(time.monotonic())
            c.retire_workers([cluster.workers()["w0"]], close_workers=True)

    threading.Thread(target=retire_w0, daemon=True).start()
    config = {**{k: pace[k] for k in ("steps", "every", "step_s")}, "faults": [gate]}
    result = cluster.train(
        storage,
        "polled",
        config,
        train_loop="tests.test_preemption_polling:polled_loop",
        max_failures=0,
        preemption_notice_s=120,
    )
    assert result.status == "finished"
    (failure,) = result.failures
    assert (failure.kind, failure.rank, failure.charged) == ("preemption", 0, False)
    # The notice came at step `hold`, after the periodic checkpoint of step `every` (report 1).
    # Polled at every step, it reached both ranks within AGREE_EVERY_MAX + 1 polls; the loop
    # reported its just-in-time checkpoint there (report 2), committed before w0 left, and the
    # run resumed from it: later than the last periodic checkpoint.
    state = load_state(storage, "polled")
    restored = state.attempts[1].restored_from
    assert restored is not None and restored.startswith("checkpoint_000002-a0-"), restored
    resumed = result.metrics["resumed_from"]
    assert pace["hold"] < resumed <= pace["hold"] + AGREE_EVERY_MAX + 1, result.metrics
    assert resumed > pace["every"]  # not the periodic checkpoint
    assert time.monotonic() - retired_at[0] < 60  # let go at the commit, not at 120 s
