"""The `ft-train` flow: one flow run is one training run, named after `run_config.name` (a
template rendered, or, where none is given, a name generated from the flow run: `named()`).

It only sequences the tasks: prepare (take the run's lease, rehydrate by name), provision
workers, train one segment per checkpoint (a task run each; retries of it are the restarts,
capped by what is left of max_failures), finalize. A rerun with the same (storage_path, name)
resumes; a finished run is returned without training again.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

from prefect import Flow
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

import ft_train
from flows import api, ephemeral
from flows.credentials import with_credentials
from flows.deployment_defaults import with_deployment_defaults
from ft_train import callbacks as user_callbacks
from ft_train.config import name_of, parse
from ft_train.driver.cluster import Ahead, check_fits, check_scheduler, start_forkserver
from ft_train.driver.lease import live_holder
from ft_train.driver.prepare import interrupt_or, loop_config, make_controller, peek
from ft_train.driver.user_callbacks import UserCallbacks
from ft_train.errors import ConfigError
from ft_train.run_name import generate, is_template, render
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore, now
from ft_train.worker.rank import load_train_loop
from tasks import finalize, prepare_run, provision_workers, train_segment
from tasks.live import LiveView
from tasks.publish import RunEvents


def train_fn(
    train_loop: str | Callable,
    run_config: ft_train.RunConfig,
    train_loop_config: dict[str, Any] | None = None,
    scaling_config: ft_train.ScalingConfig = ft_train.ScalingConfig(),
    cluster: ft_train.ClusterConfig = ft_train.ClusterConfig(),
) -> ft_train.TrainResult:
    """Fault-tolerant distributed PyTorch training.

    Args:
        train_loop: the training function, as 'package.module:function' (a callable is accepted
            in a Python call); it runs on every rank with `train_loop_config`.
        run_config: the run's identity (storage_path, name), failure and checkpoint settings;
            without a name, the flow run generates one (a new run) and is named so.
        train_loop_config: JSON-serialisable settings passed to the training function.
        scaling_config: how many ranks, CPU or GPU.
        cluster: a local Dask cluster (default), a cluster class ft-train starts, the address
            of an existing one, or (a Python call) a live cluster object.
    """
    run_config = named(run_config)  # a template, or no name: this flow run's own
    run_config = with_credentials(run_config)  # after Prefect stored the parameters
    check_fits(cluster, scaling_config)
    check_scheduler(cluster)  # before prepare_run: a wrong address leaves the storage untouched
    mine = user_callbacks.load_all(run_config)  # a path that does not import: nothing starts
    since = now()  # what prepare_run records (a crashed driver's end) is told to the callbacks
    plan = prepare_run(train_loop, train_loop_config, scaling_config, run_config)
    if plan.finished:
        return finalize(plan)
    events, view = RunEvents(plan), LiveView(plan)
    with contextlib.ExitStack() as stack:
        # the user's callbacks take what is queued last: after the workers and the lease
        users = stack.enter_context(UserCallbacks.of(mine, plan, scaling_config, since))
        stack.callback(plan.release)  # the run's lease, last: after the workers are gone
        client = provision_workers(cluster, scaling_config, stack)
        watchers = [events, view, users]
        controller = make_controller(plan, client, warm=cluster.preload, callbacks=watchers)
        try:
            segment, finished = 0, False
            while not finished:
                segment += 1
                retries = controller.retries_left()
                step = train_segment.with_options(retries=retries, retry_delay_seconds=0)
                finished = step(controller, segment)
        except BaseException as e:
            why = interrupt_or(e)
            controller.abort(why)  # stop the ranks; record why (Ctrl+C is not charged)
            if plan.state.status == "failed":
                finalize(plan, view)
            if why is e:
                raise
            raise why from None  # the Ctrl+C itself, not the error Prefect raised in its place
    result = finalize(plan, view)
    result.return_value = controller.return_value  # rank 0's, in memory: never through Prefect
    return result


def named(run: ft_train.RunConfig) -> ft_train.RunConfig:
    """`run` with the name this flow run trains (`ft_train.run_name`): a template rendered from
    the flow run's scheduled start time; no name, one generated from the flow run's id and
    creation time (Ray generates one too). Both are facts of the flow run that never change, so
    every call in it gives the same name, and the flow run is named so (`_flow_run_name`): the
    recovery automation's rerun of a crashed flow run passes that name on, and resumes it. In a
    deployment's flow run, a run config given in part keeps the deployment's other fields first
    (`flows.deployment_defaults`)."""
    run = with_deployment_defaults(run)
    if run.name is None:
        return run.model_copy(update={"name": _generated_name()})
    if is_template(run.name):
        return run.model_copy(update={"name": render(run.name, flow_run.scheduled_start_time)})
    return run


def _generated_name() -> str:
    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    created = None if run is None else run.created or run.expected_start_time
    if run is None or created is None:  # a flow run read from the API has both
        raise ConfigError(
            "run_config.name is not given, and a name is generated only in a flow run: "
            "give run_config.name"
        )
    return generate(run.id, created)


def _flow_run_name() -> str:
    context = FlowRunContext.get()
    run = context.parameters["run_config"] if context and context.parameters else None
    return name_of(named(parse(ft_train.RunConfig, run, "run_config")))


def _nothing_to_train(run: ft_train.RunConfig) -> bool:
    """Will the call train nothing: has the run finished, does `run.resume` refuse it (by the
    run's existence; a changed config is found later), or is another driver training it? A
    cluster started for it would only take CPU from Prefect's start (and from that driver's
    ranks), then take seconds to close. Asked of local storage only, which answers at once:
    remote storage that cannot be reached (S3: 10 s of retries) would delay the call, then the
    flow's own read would fail after as long again."""
    storage = Storage(run.storage_path, run.storage_options)
    if not storage.is_local or run.name is None or is_template(run.name):
        return False  # the name is the flow run's: a new run, or a template's
    state = peek(run, storage, RunStore(storage, run.name))  # raises for a run that cannot start
    if state is None:
        return run.resume == "must"  # refused
    if run.resume == "never" or (state.status == "finished" and not run.allow_train_loop_change):
        return True
    return live_holder(storage, run.name) is not None


class _TrainFlow(Flow):
    """The flow, and three things more for a Python call. Its parameters are checked first, so
    that bad input raises ConfigError before anything starts (a deployment's are checked by
    Prefect, then by the flow), and then the API that PREFECT_API_URL names, if any
    (`flows.api`). Prefect's temporary API server, where Prefect would start one,
    starts at once (`flows.ephemeral`). On a local CPU cluster, that
    cluster starts on a thread at once too (its workers fork from a server that imports torch);
    the flow's run takes it over. Not for a run on local storage that has finished, or that
    another driver is training. Deployment runs start the cluster in the flow."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cluster, scaling, run, call = _checked(self.fn, args, kwargs)  # bad input: nothing starts
        api.check_reachable()  # a server that is down: one line, not Prefect's retries
        # the parsed config, not a dict: Prefect stores it with its credentials hidden
        args, kwargs = (), {**call.arguments, "run_config": run}
        server = ephemeral.start()  # first: it is the longest to start
        ahead = None
        with contextlib.suppress(Exception):  # what fails here fails in the flow, as without this
            if cluster.is_default_local and not scaling.use_gpu and not _nothing_to_train(run):
                start_forkserver(cluster.preload)
                ahead = Ahead(cluster, scaling)
        try:
            with ephemeral.api(server):
                return super().__call__(*args, **kwargs)
        finally:
            if ahead is not None:
                ahead.drop()  # closes it if the run did not take it


def _checked(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any, Any, Any]:
    """A Python call's parameters, checked as the flow checks them, before Prefect, a flow run
    or a cluster starts: ConfigError (TrainLoopImportError) naming the field and the fix."""
    try:
        call = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        names = ", ".join(inspect.signature(fn).parameters)
        raise ConfigError(f"train(): {e}; its parameters are {names}") from None
    call.apply_defaults()
    p = call.arguments
    cluster = parse(ft_train.ClusterConfig, p["cluster"], "cluster")
    scaling = parse(ft_train.ScalingConfig, p["scaling_config"], "scaling_config")
    run = parse(ft_train.RunConfig, p["run_config"], "run_config")
    load_train_loop(p["train_loop"])
    user_callbacks.load_all(run)  # built to check them, and again in the flow (cheap: at hooks)
    loop_config(p["train_loop_config"])
    check_fits(cluster, scaling)
    return cluster, scaling, run, call


# No result persisted: the result's checkpoints carry the storage options, credentials included.
train = _TrainFlow(train_fn, name="ft-train", flow_run_name=_flow_run_name, persist_result=False)
