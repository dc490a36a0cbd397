"""The Prefect tasks of a training run.

They run in the flow process (the flow calls them directly): a Prefect task that ran *on* a Dask
worker would lose its retries when that worker dies. The ranks are Dask futures driven from here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Union

from prefect import get_run_logger, task
from prefect.runtime import flow_run
from prefect.cache_policies import NO_CACHE

import ft_train
from ft_train.cluster import dask_client
from ft_train.controller import Controller, Segment
from ft_train.driver import RunPlan, make_controller
from ft_train.driver import prepare_run as _prepare_run
from ft_train.errors import WorkerGroupError


@task(name="prepare-run", cache_policy=NO_CACHE)
def prepare_run(
    train_loop: Union[str, Callable],
    train_loop_config: Optional[dict[str, Any]],
    scaling_config: ft_train.ScalingConfig,
    run_config: ft_train.RunConfig,
) -> RunPlan:
    """Validate the input, take the run's lease (one driver per run) and rehydrate the run
    state from storage (one read)."""
    holder = f"flow run {flow_run.name!r} ({flow_run.id})" if flow_run.id else ""
    return _prepare_run(
        train_loop, train_loop_config, scaling_config, run_config, get_run_logger().info, holder
    )


@task(name="provision-workers", cache_policy=NO_CACHE)
def provision_workers(
    cluster: ft_train.ClusterConfig, scaling_config: ft_train.ScalingConfig, stack: contextlib.ExitStack
):
    """Connect to the Dask cluster (starting a local one by default); closed with `stack`."""
    client = stack.enter_context(dask_client(cluster, scaling_config))
    get_run_logger().info(f"Dask scheduler {client.scheduler.address}")
    return client


def _retry_group_failures(task, task_run, state) -> bool:
    """Only a worker-group failure is retried; the controller already applied max_failures."""
    try:
        state.result()
    except WorkerGroupError:
        return True
    except BaseException:
        return False
    return False


@task(
    name="train-until-checkpoint",
    task_run_name="train-{segment}",
    cache_policy=NO_CACHE,
    retry_condition_fn=_retry_group_failures,
)
def train_segment(controller: Controller, segment: int) -> Segment:
    """Train until the next committed checkpoint; raise on a group failure (a retry restarts the
    group from the latest committed checkpoint)."""
    controller.log = get_run_logger().info
    return controller.run_segment()


@task(name="finalize", cache_policy=NO_CACHE)
def finalize(plan: RunPlan) -> ft_train.TrainResult:
    result = plan.result()
    get_run_logger().info(
        f"run {plan.run_config.name!r} {result.status}: {len(result.best_checkpoints)} checkpoints "
        f"kept, {len(result.failures)} failures, at {result.path}"
    )
    return result


__all__ = ["prepare_run", "provision_workers", "train_segment", "finalize", "make_controller"]
