"""The `ft-train` flow: one flow run is one training run, named after `run_config.name`.

It only sequences the tasks: prepare (rehydrate by name), provision workers, train one segment
per checkpoint (a task run each; retries of it are the restarts, capped by what is left of
max_failures), finalize. A rerun with the same (storage_path, name) resumes; a finished run is
returned without training again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from typing import Any, Callable, Optional, Union

from prefect import Flow

import ft_train
from ft_train.cluster import started_ahead
from ft_train.driver import make_controller
from ft_train.run_state import RunStore
from ft_train.storage import Storage
from tasks import finalize, prepare_run, provision_workers, train_segment


def train_fn(
    train_loop: Union[str, Callable],
    run_config: ft_train.RunConfig,
    train_loop_config: Optional[dict[str, Any]] = None,
    scaling_config: ft_train.ScalingConfig = ft_train.ScalingConfig(),
    cluster: ft_train.ClusterConfig = ft_train.ClusterConfig(),
) -> ft_train.TrainResult:
    """Fault-tolerant distributed PyTorch training.

    Args:
        train_loop: the training function, as 'package.module:function' (a callable is accepted
            in a Python call); it runs on every rank with `train_loop_config`.
        run_config: the run's identity (storage_path, name), failure and checkpoint settings.
        train_loop_config: JSON-serialisable settings passed to the training function.
        scaling_config: how many ranks, CPU or GPU.
        cluster: a local Dask cluster (default) or the address of an existing one.
    """
    plan = prepare_run(train_loop, train_loop_config, scaling_config, run_config)
    if plan.finished:
        return finalize(plan)
    with contextlib.ExitStack() as stack:
        client = provision_workers(cluster, scaling_config, stack)
        controller = make_controller(plan, client)
        try:
            segment, kind = 0, "checkpoint"
            while kind != "finished":
                segment += 1
                retries = controller.retries_left()
                step = train_segment.with_options(retries=retries, retry_delay_seconds=0)
                kind = step(controller, segment).kind
        except BaseException as e:
            controller.abort(e)  # stop the ranks; record why (Ctrl+C is not charged)
            raise
    return finalize(plan)


class _TrainFlow(Flow):
    """The flow, and one thing more for a Python call: a run on a local Dask cluster starts that
    cluster while Prefect starts its API (seconds each in ephemeral mode), when the input is
    valid and the run is not finished already. Deployment runs do not go through here."""

    def __call__(self, *args, **kwargs):
        settings = _cluster_to_start(self.fn, args, kwargs)
        if settings is None:
            return super().__call__(*args, **kwargs)
        with started_ahead(*settings):
            return super().__call__(*args, **kwargs)


def _cluster_to_start(fn, args, kwargs):
    """(cluster, scaling) of a call that will start a local cluster; None if in doubt (bad
    input keeps its usual error, from the flow, before any worker starts)."""
    try:
        call = inspect.signature(fn).bind(*args, **kwargs)
        call.apply_defaults()
        p = call.arguments
        run = ft_train.RunConfig.model_validate(p["run_config"])
        scaling = ft_train.ScalingConfig.model_validate(p["scaling_config"])
        cluster = ft_train.ClusterConfig.model_validate(p["cluster"])
        loop = p["train_loop"]
        if cluster.address is not None or not (
            callable(loop) or importlib.util.find_spec(loop.partition(":")[0]) is not None
        ):
            return None
        state = RunStore(Storage(run.storage_path, run.storage_options), run.name).load()
        if state is not None and state.status == "finished":
            return None
        return cluster, scaling
    except Exception:
        return None


train = _TrainFlow(train_fn, name="ft-train", flow_run_name="{run_config.name}")
