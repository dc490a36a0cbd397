"""The rank side on a real Dask worker, without the controller: report() never waits for the
driver, report rounds consolidate every rank's k-th report, a group that cannot start says why."""

import pytest

import ft_train
from ft_train.controller.rounds import ReportRounds
from ft_train.driver.cluster import dask_client
from ft_train.protocol import RankSpec, message
from ft_train.storage.fs import Storage
from ft_train.worker.rank import free_port, run_rank


def test_report_does_not_wait_for_the_driver(tmp_path):
    # Nobody listens to the rank's topic: if report() waited for the driver in any way, the
    # rank would never finish its 500 reports.
    with dask_client(ft_train.ClusterConfig(n_workers=1), ft_train.ScalingConfig()) as client:
        addr = next(iter(client.scheduler_info()["workers"]))
        spec = RankSpec(
            train_loop="tests.loops:report_many",
            config={"n": 500},
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            node_rank=0,
            name="nobody-listens",
            attempt=0,
            attempt_id="0" * 32,
            master_addr="127.0.0.1",
            master_port=client.run(free_port, workers=[addr])[addr],
            backend="gloo",
            use_gpu=False,
            storage=Storage(str(tmp_path)),
            checkpoint_dir=None,
            start_report_index=0,
            topic="ft-train-nobody-listens",
            collective_timeout_s=1800.0,
            agreement_interval_s=0.0,
        )
        done = client.submit(run_rank, spec, workers=[addr], pure=False).result(timeout=120)
    assert done == {"rank": 0, "reports": 500}


def test_rounds_complete_in_order_once_every_rank_reported():
    rounds = ReportRounds(world_size=2, last_index=4)
    rounds.add(
        message(
            {
                "rank": 1,
                "index": 5,
                "metrics": {"r": 1},
                "dir_name": "checkpoint_000005-a0-x",
                "files": {"b": {}},
            }
        )
    )
    rounds.add(message({"rank": 1, "index": 6, "metrics": {"r": 1}}))
    assert rounds.pop_complete() is None  # rank 0 has not reported round 5 yet
    rounds.add(message({"rank": 0, "index": 6, "metrics": {"r": 0}}))
    assert rounds.pop_complete() is None  # round 6 waits for round 5
    rounds.add(
        message(
            {
                "rank": 0,
                "index": 5,
                "metrics": {"r": 0},
                "dir_name": "checkpoint_000005-a0-x",
                "files": {"a": {}},
            }
        )
    )
    five = rounds.pop_complete()
    assert (five.index, five.metrics, sorted(five.files)) == (5, {"r": 0}, ["a", "b"])
    six = rounds.pop_complete()
    assert (six.index, six.dir_name) == (6, None)
    assert rounds.pop_complete() is None


def test_the_hung_rank_is_the_one_furthest_behind_even_if_never_heard_from():
    from ft_train.policy.attribution import hung_rank

    # rank 1 reported up to 10 and then timed out waiting for a peer (it is `waiting`); rank 0
    # froze before its first batch reached the driver, so nothing at all came from it
    assert hung_rank(range(2), {}, 1, {1: 10}, {1: 5.0}) == 0
    # of several running ranks: fewest reports, then heard from least recently
    assert hung_rank(range(3), {}, None, {0: 9, 1: 8, 2: 8}, {0: 3.0, 1: 2.0, 2: 1.0}) == 2
    # ranks that returned are not it; the waiting one is, when every other rank returned
    assert hung_rank(range(2), {0: {}}, None, {0: 9, 1: 10}, {0: 1.0, 1: 2.0}) == 1
    assert hung_rank(range(2), {0: {}}, 1, {0: 9, 1: 10}, {0: 1.0, 1: 2.0}) == 1


def test_a_group_that_cannot_start_says_how_many_workers_the_run_lost_before(tmp_path):
    # One worker, and it is one the run lost or killed before (a worker without a nanny does
    # not come back): the error names them, not only the workers that were there.
    from ft_train.controller.ports import GroupPlan
    from ft_train.driver.placement import await_workers
    from ft_train.errors import WorkerStartupError

    with dask_client(ft_train.ClusterConfig(n_workers=1), ft_train.ScalingConfig()) as client:
        addr = next(iter(client.scheduler_info()["workers"]))
        plan = GroupPlan(
            train_loop="tests.loops:report_many",
            config={},
            name="lost-before",
            storage=Storage(str(tmp_path)),
            min_workers=1,
            max_workers=1,
            use_gpu=False,
            start_timeout_s=0.5,
            collective_timeout_s=1800.0,
            agreement_interval_s=0.0,
            elastic_wait_s=0.0,
        )
        with pytest.raises(WorkerStartupError) as err:
            await_workers(client, plan, exclude={addr, "tcp://127.0.0.1:1"})
    assert "only 0 of 1 Dask workers" in str(err.value)
    assert "(2 lost or killed in this run's earlier attempts)" in str(err.value)
