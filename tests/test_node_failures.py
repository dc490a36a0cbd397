"""Worker node failures on an existing Dask cluster (reached by address), whose workers are
separate `dask worker` processes without nannies: a lost worker is gone for good."""

import os
import signal
import sys
import time

import pytest
from distributed import Client

import ft_train
from ft_train.knobs import AGREE_EVERY_MAX
from tests.conftest import StorageTarget, on_storage
from tests.external_clusters import ExternalCluster
from tests.helpers import demo_config, fault, load_state, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")


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


@on_storage("local")
def test_lost_worker_of_rank_1_is_replaced_and_the_run_resumes(storage, tmp_path, cluster):
    # rank 1 (on worker w1: ranks follow worker names) holds at step 7, after the checkpoint of
    # step 5, so the test can take its machine away mid-run
    hold = fault(tmp_path, 1, 7, kind="wait")
    name = "node-loss"

    def take_away_w1():
        wait_for(lambda: os.path.exists(hold["marker"]), 240, "rank 1 to reach step 7")
        killed_at = time.time()
        cluster.kill("w1")
        cluster.add_worker("w3")  # the replacement
        return killed_at

    import threading

    killed = {}
    chaos = threading.Thread(target=lambda: killed.setdefault("at", take_away_w1()), daemon=True)
    chaos.start()
    scaling = ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=120)
    result = cluster.train(
        storage, name, demo_config([hold]), scaling=scaling, max_failures=1, preload=["wave"]
    )
    chaos.join(timeout=10)
    assert result.status == "finished" and result.last_metrics["resumed_from"] == 5
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("node_loss", 1)
    # the scheduler's own signal: detected at once, not after a collective or watchdog timeout
    assert failure.time.timestamp() - killed["at"] < 5
    state = load_state(storage, name)
    assert [a.world_size for a in state.attempts] == [2, 2]
    workers = cluster.workers()
    assert "w1" not in workers
    # cluster.preload: imported by the workers of an existing cluster too (the second group's
    # were a rank's and the idle one's)
    with Client(cluster.address, timeout=30) as client:
        warm = client.run(lambda: "wave" in sys.modules, workers=[workers["w0"], workers["w2"]])
    assert list(warm.values()) == [True, True], warm


def test_a_lost_worker_is_charged_even_when_the_schedulers_word_of_it_is_late(
    tmp_path, cluster, monkeypatch
):
    """The scheduler's word that w1 left (its "remove-worker" event) does not reach the driver,
    as when a loaded machine holds it up. Rank 0's error says only that it lost its peer: after
    COLLATERAL_WAIT_S the driver looks at the scheduler's worker list itself and charges the
    failure to the lost worker. Blamed instead, rank 0 would have had its healthy worker
    killed, and with w1 gone for good only w2 would have been left for a group of two."""
    from ft_train.driver.worker_group import WorkerGroup

    monkeypatch.setattr(WorkerGroup, "_on_scheduler_event", lambda self, event: None)
    hold = fault(tmp_path, 1, 7, kind="wait")

    def take_away_w1():
        wait_for(lambda: os.path.exists(hold["marker"]), 240, "rank 1 to reach step 7")
        cluster.kill("w1")

    import threading

    threading.Thread(target=take_away_w1, daemon=True).start()
    storage = StorageTarget("local", str(tmp_path / "runs"))
    scaling = ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=30)
    result = cluster.train(
        storage, "late-word", demo_config([hold]), scaling=scaling, max_failures=1
    )
    assert result.status == "finished" and result.last_metrics["resumed_from"] == 5
    assert [(f.kind, f.rank) for f in result.failures] == [("node_loss", 1)]
    assert {"w0", "w2"} <= set(cluster.workers())  # the new group's


def test_too_few_workers_fail_with_a_clear_error(storage, cluster):
    with pytest.raises(ft_train.WorkerStartupError, match="worker_start_timeout_s"):
        scaling = ft_train.ScalingConfig(num_workers=4, worker_start_timeout_s=2)
        cluster.train(storage, "too-few", train_loop="tests.loops:report_many", scaling=scaling)
    assert load_state(storage, "too-few").status == "failed"


@on_storage("s3")
def test_sigterm_to_a_worker_gives_notice_and_a_just_in_time_checkpoint(storage, tmp_path, cluster):
    # rank 0 (on worker w0) holds at step 7 until its worker has notice to leave
    gate = fault(tmp_path, 0, 7, kind="until_preempted")

    def preempt_w0():
        wait_for(lambda: os.path.exists(gate["marker"]), 240, "rank 0 to reach step 7")
        os.kill(cluster.procs["w0"].pid, signal.SIGTERM)

    import threading

    threading.Thread(target=preempt_w0, daemon=True).start()
    config = demo_config([gate], epochs=3)  # 36 steps
    result = cluster.train(storage, "preempted", config, max_failures=0, preemption_notice_s=60)
    assert result.status == "finished"
    (failure,) = result.failures
    assert (failure.kind, failure.rank, failure.charged) == ("preemption", 0, False)
    state = load_state(storage, "preempted")
    # rank 0 had notice at the report of step 8; the ranks agree every few calls of report()
    # and get_preemption_info() (the demo makes one of each a step, milliseconds apart here:
    # FailureConfig.agreement_interval_s), so every rank learned it at the same call within
    # AGREE_EVERY_MAX calls of it; the loop saved a just-in-time checkpoint there (an extra
    # report, unless that step checkpointed anyway) that was committed before w0 left, and the
    # run resumed from it
    learned = result.last_metrics["resumed_from"]
    assert 8 <= learned <= 8 + AGREE_EVERY_MAX
    jit_index = learned if learned % config["checkpoint_every"] == 0 else learned + 1
    jit = state.attempts[1].restored_from
    assert jit is not None and jit.startswith(f"checkpoint_{jit_index:06d}-a0-")
    assert "w0" not in cluster.workers()  # it left; the run went on on w1 and w2


@on_storage("s3")
def test_elastic_group_goes_on_with_fewer_workers_then_grows_back(storage, tmp_path, cluster):
    cluster.kill("w2")  # two workers: w0 and w1
    wait_for(lambda: "w2" not in cluster.workers(), 60, "w2 to leave")
    lose_w1 = fault(tmp_path, 1, 4, kind="wait")  # rank 1 holds at step 4: take w1 away
    release = tmp_path / "release"
    on_one = {**fault(tmp_path, 0, 8, kind="until_file"), "path": str(release)}

    def operator():
        wait_for(lambda: os.path.exists(lose_w1["marker"]), 240, "rank 1 to reach step 4")
        cluster.kill("w1")  # lost, and not replaced
        wait_for(lambda: os.path.exists(on_one["marker"]), 240, "the group of one at step 8")
        sizes = [a.world_size for a in load_state(storage, "elastic").attempts]
        cluster.add_worker("w3")  # a worker comes back
        cluster.wait_workers(["w3"])
        release.write_text(" ".join(map(str, sizes)))

    import threading

    threading.Thread(target=operator, daemon=True).start()
    config = demo_config([lose_w1, on_one], epochs=2, checkpoint_every=3)
    scaling = ft_train.ScalingConfig(num_workers=(1, 2), elastic_wait_s=1)
    result = cluster.train(storage, "elastic", config, scaling=scaling, max_failures=1)
    assert result.status == "finished"
    assert release.read_text() == "2 1"  # it went on with one worker rather than waiting
    assert [(f.kind, f.rank) for f in result.failures] == [("node_loss", 1)]  # a resize is not
    state = load_state(storage, "elastic")
    assert [a.world_size for a in state.attempts] == [2, 1, 2]  # grew back once w3 came
    # grown at a checkpoint boundary of the group of one
    assert "-a1-" in state.attempts[2].restored_from


@pytest.mark.parametrize(
    "storage, close",
    [("local", True), ("s3", False)],
    ids=["local-closed", "s3-removed"],
    indirect=["storage"],
)
def test_a_retired_worker_gives_notice_and_a_just_in_time_checkpoint(
    storage, tmp_path, cluster, close
):
    # rank 0 (on worker w0) holds at step 7 until its worker has notice to leave
    gate = fault(tmp_path, 0, 7, kind="until_preempted")
    retired_at = []

    def retire_w0():
        wait_for(lambda: os.path.exists(gate["marker"]), 240, "rank 0 to reach step 7")
        with Client(cluster.address, timeout=30) as c:
            retired_at.append(time.monotonic())
            c.retire_workers([cluster.workers()["w0"]], close_workers=close)

    import threading

    threading.Thread(target=retire_w0, daemon=True).start()
    config = demo_config([gate])
    # agreement_interval_s=0: the ranks agree at every report, so the report they learn at is exact
    result = cluster.train(
        storage,
        f"retired-{close}",
        config,
        max_failures=0,
        preemption_notice_s=120,
        agreement_interval_s=0,
    )
    assert result.status == "finished"
    (failure,) = result.failures
    assert (failure.kind, failure.rank, failure.charged) == ("preemption", 0, False)
    # rank 0 had notice at the report of step 8, every rank learned it at the next call (the
    # agreement started at one call is read at the next), step 8's get_preemption_info(); the
    # loop saved a just-in-time checkpoint (report 9), committed before w0 left, and the run
    # resumed from it
    state = load_state(storage, f"retired-{close}")
    jit = state.attempts[1].restored_from
    assert jit is not None and jit.startswith("checkpoint_000009-a0-")
    assert result.last_metrics["resumed_from"] == 8
    # w0 was let go once the checkpoint was committed, not when its notice ran out
    assert time.monotonic() - retired_at[0] < 60
    wait_for(lambda: "w0" not in cluster.workers(), 30, "w0 to leave")


@pytest.mark.timeout(240)
def test_frozen_idle_workers_are_passed_over_when_a_group_starts(tmp_path, cluster):
    """w0, w1 and w2 (first in rank order) are frozen before the run (SIGSTOP: as machines that
    hang); w3 and w4 join. The frozen ones still look alive to the scheduler (worker-ttl, 5
    minutes by default), so the group's start must find out itself: they do not answer within
    ANSWER_TIMEOUT_S, and the ranks start on w3 and w4. Each worker is asked on its own, all at
    once: asking them one by one took ANSWER_TIMEOUT_S per frozen worker (15 s here), and
    before that, asking w0 for the rendezvous port waited until the scheduler dropped it."""
    from ft_train.knobs import ANSWER_TIMEOUT_S

    storage = StorageTarget("local", str(tmp_path / "runs"))
    for name in ("w3", "w4"):
        cluster.add_worker(name)
    cluster.wait_workers(["w3", "w4"])
    for name in ("w0", "w1", "w2"):
        cluster.kill(name, signal.SIGSTOP)
    called = time.time()
    result = cluster.train(storage, "frozen-idle", demo_config())
    assert result.status == "finished" and not result.failures
    (attempt,) = load_state(storage, "frozen-idle").attempts
    assert attempt.world_size == 2
    # the plugin's broadcast, then one probe of each worker, all at once: 2 x ANSWER_TIMEOUT_S
    assert attempt.started_at.timestamp() - called < 2 * ANSWER_TIMEOUT_S + 10
    assert {"w0", "w1", "w2"} <= set(cluster.workers())  # still listed: only the probe tells
