"""The rank side on a real Dask worker, without the controller: report() never waits for the
driver, report rounds consolidate every rank's k-th report, a group that cannot start says why."""

import pytest

import ft_train
from ft_train.driver.cluster import dask_client
from ft_train.protocol import RankSpec
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
