"""The Prefect tasks of a training run.

They run in the flow process (the flow calls them directly): a Prefect task that ran *on* a Dask
worker would lose its retries when that worker dies. The ranks are Dask futures driven from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from uuid import UUID

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Crashed

import ft_train
from ft_train.config import name_of
from ft_train.controller import Controller
from ft_train.driver.cluster import dask_client
from ft_train.driver.lease import LeaseDoc
from ft_train.driver.prepare import RunPlan, make_controller
from ft_train.driver.prepare import prepare_run as _prepare_run
from ft_train.errors import AttemptFailed
from ft_train.storage.metric_history import MetricHistory, load_history
from ft_train.wording import plural

from .live import LiveView
from .publish import publish_artifacts


# prepare-run's and finalize's results hold the storage options, credentials included: never
# persisted, whatever PREFECT_RESULTS_PERSIST_BY_DEFAULT says.
@task(name="prepare-run", cache_policy=NO_CACHE, persist_result=False)
def prepare_run(
    train_loop: str | Callable,
    train_loop_config: dict[str, Any] | None,
    scaling_config: ft_train.ScalingConfig,
    run_config: ft_train.RunConfig,
) -> RunPlan:
    """Validate the input, take the run's lease (one driver per run) and rehydrate the run
    state from storage (one read)."""
    holder = f"flow run {flow_run.name!r} ({flow_run.id})" if flow_run.id else ""
    plan = _prepare_run(
        train_loop,
        train_loop_config,
        scaling_config,
        run_config,
        get_run_logger().info,
        holder,
        flow_run.id or "",
    )
    _crash_flow_run_of(plan.lease.previous)
    return plan


# How the Crashed state below begins: the recovery automation (`deployments/automations.py`)
# reruns no flow run that ends so, as this driver already trains the run.
TAKEN_OVER = "ft-train takeover:"


def _crash_flow_run_of(previous: LeaseDoc | None) -> None:
    """The run was taken over from a driver that was killed (its lease not released). Prefect
    still shows that driver's flow run Running when nothing reported its end (a Python call has
    no worker to; a lost machine's worker died with it): mark it Crashed, so the UI tells the
    truth, with a message that the recovery automation knows (`TAKEN_OVER`)."""
    if previous is None or previous.released or previous.holder_id in ("", flow_run.id):
        return
    log = get_run_logger()
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(previous.holder_id))
            if run.state is not None and run.state.is_running():
                message = f"{TAKEN_OVER} its driver (pid {previous.pid} on {previous.host}) "
                message += f"was gone when flow run {flow_run.name!r} took the training run over"
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                log.info(f"marked the flow run {run.name!r} of the gone driver Crashed")
    except Exception as e:  # another Prefect server's run, or none: only the UI loses
        log.warning(f"could not mark the gone driver's flow run Crashed ({type(e).__name__}: {e})")


@task(name="provision-workers", cache_policy=NO_CACHE)
def provision_workers(
    cluster: ft_train.ClusterConfig,
    scaling_config: ft_train.ScalingConfig,
    stack: contextlib.ExitStack,
):
    """Connect to the Dask cluster (starting a local one by default); closed with `stack`."""
    client = stack.enter_context(dask_client(cluster, scaling_config))
    get_run_logger().info(f"Dask scheduler {client.scheduler.address}")
    return client


def _retry_group_failures(task, task_run, state) -> bool:
    """Only a failed group attempt is retried (`AttemptFailed`); the controller already applied
    max_failures (a spent budget raises WorkerGroupError, the run's final error: not retried)."""
    try:
        state.result()
    except AttemptFailed:
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
def train_segment(controller: Controller, segment: int) -> bool:
    """Train until the next committed checkpoint; raise on a group failure (a retry restarts the
    group from the latest committed checkpoint). True once the run finished.

    Returns a bool, not the `Segment`: Prefect keeps each task run's result in the flow run until
    it ends (a state per result field), so a small result keeps a long run's driver flat."""
    log = get_run_logger()
    controller.log, controller.warn = log.info, log.warning
    return controller.run_segment().kind == "finished"


@task(name="finalize", cache_policy=NO_CACHE, persist_result=False)
def finalize(plan: RunPlan, view: LiveView | None = None) -> ft_train.TrainResult:
    """The run's result, and its checkpoints, failures and summary as artifacts of the flow
    run. Also called for a run that failed, before its error is raised: what cannot be
    published is logged, not raised.

    The run's end reads storage once: its whole checkpoint index here (the head is
    `plan.state`), and its metric history only for a run that did not train here (`view` is
    None); a run that trained here has it in memory, current (`plan.history`). The result, the
    checkpoint table and the live view are all given what was read."""
    entries = plan.store.all_checkpoints(plan.state)  # a damaged index fails the call, as before
    if view is None:
        plan.history = _stored_history(plan)
        view = LiveView(plan)
    result = ft_train.TrainResult.from_state(
        plan.storage,
        plan.state,
        plan.run_config.checkpoint_config,
        entries=entries,
        history=plan.history,
    )
    log = get_run_logger()
    log.info(
        f"run {plan.run_config.name!r} {result.status}: "
        f"{plural(len(result.best_checkpoints), 'checkpoint')} kept, "
        f"{plural(len(result.failures), 'failure')}, at {result.path}"
    )
    try:
        publish_artifacts(plan, entries, view)
    except Exception as e:  # the run's own outcome stands; only the UI loses
        log.warning(f"could not publish the run's artifacts ({type(e).__name__}: {e})")
    return result


def _stored_history(plan: RunPlan) -> MetricHistory:
    try:
        return load_history(plan.storage, name_of(plan.run_config))
    except Exception:  # it only informs (damaged, or storage out): shown empty
        return MetricHistory()


__all__ = ["prepare_run", "provision_workers", "train_segment", "finalize", "make_controller"]
