"""`ft_train.torch.TorchTrainer(...).fit()` end to end: a Python call of the ft-train flow on a
local Dask cluster (gloo), on the session's Prefect API. It returns what the flow returns, raises
what the run failed with, and a run without a name gets one per flow run, which a rerun of that
flow run with the recovery automation's parameters resumes."""

from __future__ import annotations

import os

import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter

import ft_train
from deployments.automations import RERUN_PARAMETERS
from flows.train import train
from ft_train.run_name import GENERATED
from ft_train.torch import TorchTrainer
from ft_train.trainer import find_flow
from tests import loops
from tests.conftest import on_storage
from tests.helpers import fault, run_config

pytestmark = pytest.mark.usefixtures("prefect_api")


def flow_runs_named(name: str) -> list:
    """The flow runs named `name` (a driver names its flow run after the run)."""
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [name]}))


@on_storage("local")
def test_fit_trains_on_two_ranks_and_returns_what_the_flow_returns(storage):
    config = {"steps": 8, "every": 4}
    run = run_config(storage, "fit-two-ranks")
    scaling = ft_train.ScalingConfig(num_workers=2)
    trainer = TorchTrainer(
        loops.fast_checkpoints, train_loop_config=config, scaling_config=scaling, run_config=run
    )
    result = trainer.fit()

    assert find_flow() is train  # fit() called the flow, found through its entry point
    assert isinstance(result, ft_train.TrainResult)
    assert result.status == "finished" and result.error is None and result.failures == []
    assert result.metrics["step"] == 8 and result.metrics["resumed_from"] == 0
    assert result.path.endswith("/fit-two-ranks")
    assert os.path.basename(os.path.dirname(result.checkpoint.path)) == "fit-two-ranks"
    # the flow called directly on the finished run returns it at once: the same result
    direct = train(
        train_loop=loops.fast_checkpoints,
        train_loop_config=config,
        scaling_config=scaling,
        run_config=run,
    )
    assert type(direct) is type(result)
    assert (direct.path, direct.status, direct.metrics) == (
        result.path,
        result.status,
        result.metrics,
    )
    assert direct.checkpoint.path == result.checkpoint.path
    assert [c.path for c, _ in direct.best_checkpoints] == [
        c.path for c, _ in result.best_checkpoints
    ]
    runs = flow_runs_named("fit-two-ranks")  # fit()'s and the direct call's
    assert [r.state.is_completed() for r in runs] == [True, True]


@on_storage("local")
def test_fit_without_a_name_is_a_new_run_each_time_named_after_its_flow_run(storage):
    trainer = TorchTrainer(
        loops.fast_checkpoints,
        train_loop_config={"steps": 4, "every": 2},
        run_config=ft_train.RunConfig(storage_path=storage.path),  # no name, as Ray allows
    )
    first, second = trainer.fit(), trainer.fit()

    names = [os.path.basename(r.path) for r in (first, second)]
    assert all(GENERATED.fullmatch(n) for n in names), names
    assert names[0] != names[1]
    assert sorted(os.listdir(storage.path)) == sorted(names)
    for result, name in zip((first, second), names):
        assert result.status == "finished" and result.metrics["step"] == 4
        assert result.metrics["resumed_from"] == 0  # trained from scratch, not the other's
        (flow_run,) = flow_runs_named(name)  # the flow run has the run's name
        assert flow_run.state.is_completed()
        assert flow_run.parameters["run_config"]["name"] is None  # as given
    assert trainer.run_config.name is None  # the trainer is unchanged, as Ray's


@on_storage("local")
def test_a_failed_fit_raises_the_runs_error_and_a_rerun_as_the_automation_makes_it_resumes(
    storage, tmp_path
):
    """Two ranks, no retries, rank 1 raises after the checkpoint at step 4: fit() raises the
    run's WorkerGroupError (a TrainingFailedError with `worker_failures`, as Ray's), not a
    Prefect error. The run was given no name: a new flow run
    with the failed one's parameters and its name as run_config.name (what the recovery
    automation passes to the rerun of a crashed one) resumes it from that checkpoint."""
    trainer = TorchTrainer(
        "tests.loops:fast_checkpoints",  # an import path: the flow run's parameters are JSON
        train_loop_config={"steps": 8, "every": 4, "faults": [fault(tmp_path, 1, 5)]},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(storage_path=storage.path),
    )
    with pytest.raises(ft_train.WorkerGroupError) as err:  # Ray's: the budget spent on ranks
        trainer.fit()
    assert isinstance(err.value, ft_train.TrainingFailedError)
    assert type(err.value).__module__ == "ft_train.errors", type(err.value)
    assert "max_failures=0" in str(err.value)
    ((rank, rebuilt),) = err.value.worker_failures.items()  # the failing rank's, rebuilt
    assert rank == 1 and rebuilt.type_name == "InjectedFault" and "Traceback" in rebuilt.traceback
    (name,) = os.listdir(storage.path)
    assert GENERATED.fullmatch(name), name
    (failed,) = flow_runs_named(name)
    assert failed.state.is_failed()

    # deployments/automations.py renders this for the rerun, from the flow run it reruns
    assert RERUN_PARAMETERS["run_config"] == (
        "{{ dict(flow_run.parameters['run_config'], name=flow_run.name) }}"
    )
    rerun = {**failed.parameters, "run_config": {**failed.parameters["run_config"], "name": name}}
    result = train(**rerun)
    assert result.status == "finished" and result.path == os.path.join(storage.path, name)
    assert result.metrics["step"] == 8 and result.metrics["resumed_from"] == 4
    assert [(f.kind, f.rank) for f in result.failures] == [("exception", 1)]
