"""The flow's result and errors with Ray's meaning, on 2 CPU ranks: a run whose max_failures is
spent on a rank that raises every time ends with `WorkerGroupError` (a TrainingFailedError) whose
`worker_failures` holds the rebuilt exception by rank, also read back with `from_path(path)`; a
run that finishes returns rank 0's return value, and `metrics` is its latest checkpoint's; a
return value that cannot be pickled ends the run at once, naming the fix.
"""

from __future__ import annotations

import os
import tempfile
import threading

import pytest
import torch

import ft_train
from ft_train.errors import RankError
from tests.conftest import on_storage
from tests.helpers import load_state

pytestmark = pytest.mark.usefixtures("prefect_api")


def raises_on_rank_1(config):
    """Rank 1 raises an exception that cannot be pickled (its class is local), every attempt."""

    class CannotPickle(Exception):
        pass

    ft_train.report({"step": 1})
    if ft_train.get_context().get_world_rank() == 1:
        raise CannotPickle(f"rank 1 gives up at attempt {config['marker']}")


def returns_a_value(config):
    """A checkpoint at report 1, a metrics-only report 2; returns what is not JSON."""
    rank = ft_train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            torch.save({"w": torch.ones(2)}, os.path.join(d, "model.pt"))
            checkpoint = ft_train.Checkpoint.from_directory(d)
        ft_train.report({"step": 1, "loss": 0.5}, checkpoint=checkpoint)
    ft_train.report({"step": 2, "loss": 0.25})
    return {"rank": rank, "weights": torch.full((2,), float(rank)), "seen": {1, 2}}


def returns_a_lock(config):
    """Rank 0 returns what cannot be pickled."""
    ft_train.report({"step": 1})
    return threading.Lock()


def flow(storage, name, loop, max_failures):
    from flows.train import train

    return train(
        train_loop=loop,
        train_loop_config={"marker": "x"},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=storage.path,
            storage_options=storage.options,
            failure_config=ft_train.FailureConfig(max_failures=max_failures),
        ),
    )


@on_storage("s3")
def test_a_spent_budget_raises_workergrouperror_with_the_rebuilt_failures(storage):
    with pytest.raises(ft_train.WorkerGroupError) as err:
        flow(storage, "spent", raises_on_rank_1, max_failures=1)
    error = err.value
    assert isinstance(error, ft_train.TrainingFailedError)  # as Ray's
    assert "max_failures=1" in str(error)
    assert str(error).count("CannotPickle: rank 1 gives up") == 2  # every failure listed
    (failure,) = error.worker_failures.values()  # the last attempt's, by rank
    assert list(error.worker_failures) == [1] and isinstance(failure, RankError)
    assert failure.type_name == "CannotPickle" and failure.rank == 1 and failure.step == 1
    assert "in raises_on_rank_1" in failure.traceback  # the rank's own traceback text
    assert len(load_state(storage, "spent").attempts) == 2  # one retry, then the budget was spent

    # The same error from the stored run, by its path (Ray's form) with storage_options
    path = f"{storage.path}/spent"
    stored = ft_train.TrainResult.from_path(path, storage_options=storage.options)
    assert stored.status == "failed" and stored.return_value is None
    assert type(stored.error) is ft_train.WorkerGroupError
    assert str(stored.error) == str(error) and stored.error.worker_failures == error.worker_failures


@on_storage("local")
def test_a_finished_run_returns_rank_0s_return_value(storage):
    result = flow(storage, "returns", returns_a_value, max_failures=0)
    assert result.status == "finished" and result.error is None
    value = result.return_value
    assert value["rank"] == 0 and value["seen"] == {1, 2}
    assert torch.equal(value["weights"], torch.zeros(2))
    assert result.metrics == {"step": 1, "loss": 0.5}  # Ray's: the latest checkpoint's
    assert result.last_metrics == {"step": 2, "loss": 0.25}
    assert [m for _, m in result.best_checkpoints] == [{"step": 1, "loss": 0.5}]
    assert ft_train.TrainResult.from_path(result.path).return_value is None  # never stored


@on_storage("local")
def test_a_return_value_that_cannot_be_pickled_fails_the_run_without_a_retry(storage):
    with pytest.raises(ft_train.SessionError, match="cannot be pickled.*return plain data"):
        flow(storage, "lock", returns_a_lock, max_failures=1)
    assert len(load_state(storage, "lock").attempts) == 1  # a retry would return the same
