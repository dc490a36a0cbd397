"""Provisioning: a Dask client for the run, to a local cluster started here or an existing one.

The local cluster runs one single-threaded worker process per rank, each under a nanny that
restarts it if it dies, plus one warm spare on CPU: a failed rank's place is taken at once by a
process that has torch imported already, while the nanny restarts the lost one in the background.
On CPU, worker processes fork from one fork server per driver process that imported torch once
(`start_forkserver`), instead of each importing it: seconds of CPU a worker, which a cold start,
a nanny's restart and the ranks' own cores (the spare's import) paid. A training function's own
heavy imports are added the same way (`ClusterConfig.preload`, or Python's
`multiprocessing.set_forkserver_preload` before the first run): the group's processes are
replaced after every failure, and each new one would import them again while the others wait.
ft-train's Dask settings (`driver.dask_settings`) stay in force for the cluster's whole life
(nannies read them again each time they restart a worker).
For GPUs, one worker per GPU with `CUDA_VISIBLE_DEVICES` set and a `GPU` resource.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import dask
from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster

from .. import knobs
from ..compat import forkserver
from ..config import ClusterConfig, ScalingConfig
from ..errors import ConfigError
from ..worker.warm import TORCH
from .dask_settings import DASK_SETTINGS
from .user_cluster import check_scheduler as check_scheduler  # where flows/ find it
from .user_cluster import load_cluster_class, user_client

logger = logging.getLogger("ft_train")

# What the fork server imports before it forks workers: what a rank needs (torch._dynamo is
# imported by the first DistributedDataParallel, about a second).
FORKSERVER_PRELOAD = ["distributed", *TORCH]

_forkserver_env: dict[str, str] | None = None  # the environment our fork server started in
_forkserver_lock = threading.Lock()


def _spawn_environ() -> dict[str, str]:
    """The environment a worker spawned now would start in: the driver's, with the variables
    a nanny sets before it starts a worker (under DASK_SETTINGS)."""
    env = dict(os.environ)
    prefix = "distributed.nanny.pre-spawn-environ."
    pre_spawn = dict(dask.config.get(prefix[:-1]))  # read, not set: other threads share the config
    pre_spawn.update(
        {k[len(prefix) :]: v for k, v in DASK_SETTINGS.items() if k.startswith(prefix)}
    )
    for k, v in pre_spawn.items():
        if v is not None:
            env.setdefault(k, str(v))
    if env.get("PYTHONHASHSEED") in (None, "0"):  # as the nanny does: one hash seed for all
        env["PYTHONHASHSEED"] = "6640"
    return env


def start_forkserver(preload: Sequence[str] = ()) -> bool:
    """Start the fork server that local CPU workers fork from, once per driver process; it
    imports its modules (`_preload`) in the background. Its environment is the one a spawned
    worker would get. Called when a local cluster starts, and earlier by a Python call of the
    flow, so that the imports overlap Prefect's start. False if a fork server that this module
    did not start runs already (its imports and environment are unknown: workers are spawned
    then). A later run's `preload` that the server lacks is imported by each worker as it joins
    (`WarmImports`)."""
    global _forkserver_env
    with _forkserver_lock:
        if _forkserver_env is not None:
            return True
        if forkserver.is_running():
            return False
        env = _spawn_environ()
        server = forkserver.the_server()
        with _environ(env):  # the server inherits it, as a nanny's spawned worker would
            server.set_forkserver_preload(_preload([*forkserver.preload_modules(), *preload]))
            server.ensure_running()
        _forkserver_env = env
        return True


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """This process's environment is `env` meanwhile (multiprocessing starts its fork server
    with it, and takes no other), then the driver's own again: the workers' variables
    (MALLOC_ARENA_MAX, ...) are not the driver's."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env.keys() - saved.keys():
            os.environ.pop(k, None)
        os.environ.update(saved)


def _preload(wanted: list[str]) -> list[str]:
    """FORKSERVER_PRELOAD, then the modules the user asked the fork server for (with
    `multiprocessing.set_forkserver_preload`, or `ClusterConfig.preload`). Python's default,
    `__main__`, is left out: the server would run a script's top level again, and a worker
    needs none of it."""
    extra = [m for m in wanted if m not in FORKSERVER_PRELOAD and m != "__main__"]
    return FORKSERVER_PRELOAD + list(dict.fromkeys(extra))


def _worker_start(preload: Sequence[str] = ()) -> tuple[str, dict[str, str]]:
    """How a local CPU cluster starts its workers now: ("forkserver", the variables to set in a
    forked worker so that it sees the driver's environment as a spawned one would), or
    ("spawn", {}) where forking cannot give that environment: a variable was removed since the
    fork server started (variables read when torch is imported, OMP_NUM_THREADS and the like,
    keep the value they had then)."""
    if not start_forkserver(preload):
        return "spawn", {}
    assert _forkserver_env is not None
    now = _spawn_environ()
    if _forkserver_env.keys() - now.keys():
        return "spawn", {}
    return "forkserver", {k: v for k, v in now.items() if _forkserver_env.get(k) != v}


def _gpu_cluster(n: int) -> SpecCluster:
    """One worker per GPU, each with a `GPU` resource: dask-cuda's LocalCUDACluster where it is
    installed (it lists each worker's own GPU first in CUDA_VISIBLE_DEVICES), else a SpecCluster
    of nannies that each see one GPU. `rank.pick_device` finds the worker's own GPU in both."""
    import torch

    available = torch.cuda.device_count()
    if available < n:
        raise ConfigError(
            f"scaling_config.use_gpu with num_workers={n} needs {n} GPUs; {available} visible. "
            "Lower num_workers, or use cluster.address for a cluster with more GPUs"
        )
    if importlib.util.find_spec("dask_cuda") is not None:
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=list(range(n)),
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            resources={"GPU": 1},
            silence_logs=logging.ERROR,
        )
    workers = {
        f"gpu-{i}": {
            "cls": Nanny,
            "options": {
                "host": "127.0.0.1",
                "nthreads": 1,
                "resources": {"GPU": 1},
                "env": {"CUDA_VISIBLE_DEVICES": str(i)},
                "silence_logs": logging.WARNING,
            },
        }
        for i in range(n)
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
    }
    return SpecCluster(scheduler=scheduler, workers=workers, silence_logs=logging.ERROR)


@contextlib.contextmanager
def _quiet_dask() -> Iterator[None]:
    """Dask logs every worker start, restart and close at INFO, and a closed comm with a
    traceback at shutdown, and a rank's death as an error. The controller reports what matters
    itself; keep Dask's own errors only."""
    quiet = {"distributed": logging.ERROR, "distributed.scheduler": logging.CRITICAL}
    loggers = [logging.getLogger(n) for n in quiet]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(quiet[lg.name])
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _local_cluster(cluster: ClusterConfig, scaling: ScalingConfig) -> Iterator[SpecCluster]:
    """A local cluster, under DASK_SETTINGS and its workers' start method for its whole life
    (nannies read them each time they start a worker); closed on exit."""
    n = cluster.n_workers or scaling.max_workers + (0 if scaling.use_gpu else knobs.SPARE_WORKERS)
    method, env = ("spawn", {}) if scaling.use_gpu else _worker_start(cluster.preload)
    settings = {**DASK_SETTINGS, "distributed.worker.multiprocessing-method": method}
    with dask.config.set(settings), _quiet_dask():
        if scaling.use_gpu:
            local = _gpu_cluster(n)
        else:
            local = LocalCluster(
                n_workers=n,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                # None still tries port 8787 and warns when it is taken; bind loopback
                dashboard_address=None,
                scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                memory_limit=0,
                silence_logs=logging.ERROR,
                env=env,
                preload=[
                    "ft_train.driver.cluster"
                ],  # dask_setup below, in each worker as it starts
            )
        with local:
            _stop_checks_of_settings_that_are_off(local)
            yield local


def _stop_checks_of_settings_that_are_off(local: SpecCluster) -> None:
    """A scheduler checks every 250 ms whether it has been idle for `idle-timeout` and whether a
    task has waited `no-workers-timeout` for a worker, even when both are off (None, the
    default). Each check wakes the driver, on a core a rank trains on: a local cluster's idle
    event loop woke 14 to 15 times a second with them, 11 without. A local cluster's scheduler
    is the run's own: stop those."""
    scheduler = local.scheduler

    async def stop() -> None:
        for name, setting in (
            ("idle-timeout", scheduler.idle_timeout),
            ("no-workers-timeout", scheduler.no_workers_timeout),
        ):
            if setting is None and name in scheduler.periodic_callbacks:
                scheduler.periodic_callbacks[name].stop()

    local.sync(stop)


def dask_setup(worker) -> None:
    """Run by each local CPU worker as it starts (a Dask worker preload). The processes a rank
    starts itself (its DataLoader workers) fork from it, as they do from a plain Python process
    on Linux, under torchrun or in a Ray actor. A worker forked from the fork server would
    otherwise start them through a fork server of its own, which outlives the worker when it is
    killed, with those processes; and spawned ones import torch again, seconds every epoch
    (9 s before the first batch of two ranks with two loader workers each, on 2 cores)."""
    multiprocessing.set_start_method("fork", force=True)


def check_fits(cluster: ClusterConfig, scaling: ScalingConfig) -> None:
    """Refuse, before anything starts, a local cluster that can never hold the group: waiting
    `worker_start_timeout_s` for workers it will never have tells the user nothing more. (An
    existing cluster may grow: `placement.await_workers` waits for it.) A cluster class must
    import, with its cluster_kwargs (`user_cluster.load_cluster_class`)."""
    if cluster.cluster_class is not None:
        load_cluster_class(cluster)
    if not cluster.is_default_local:
        return
    if cluster.n_workers is not None and cluster.n_workers < scaling.min_workers:
        raise ConfigError(
            f"scaling_config.num_workers={scaling.num_workers!r} needs {scaling.min_workers} "
            f"workers, but the local cluster has cluster.n_workers={cluster.n_workers}; raise "
            "cluster.n_workers (or leave it unset: one per rank, plus a spare), or lower "
            "scaling_config.num_workers"
        )
    if scaling.use_gpu:
        import torch

        available = torch.cuda.device_count()
        if available < scaling.min_workers:
            raise ConfigError(
                f"scaling_config.use_gpu with num_workers={scaling.num_workers!r} needs "
                f"{scaling.min_workers} GPUs; {available} visible. Lower num_workers, or use "
                "cluster.address for a cluster with more GPUs"
            )


class Ahead:
    """A local CPU cluster started on a thread ahead of its run: a Python call of the flow starts
    it while Prefect starts its API, and the run's `dask_client` takes it over (with the settings
    it lives under). `drop()` closes it if no run took it (a finished run, bad input)."""

    def __init__(self, cluster: ClusterConfig, scaling: ScalingConfig):
        self.key = (cluster.n_workers, scaling.max_workers)
        self.stack = contextlib.ExitStack()
        self.future: Future[SpecCluster] = Future()
        with _ahead_lock:
            _ahead.append(self)
        threading.Thread(
            target=self._start, args=(cluster, scaling), name="ft-train-cluster-ahead", daemon=True
        ).start()

    def _start(self, cluster: ClusterConfig, scaling: ScalingConfig) -> None:
        try:
            self.future.set_result(self.stack.enter_context(_local_cluster(cluster, scaling)))
        except BaseException as e:  # the run that takes it raises it
            self.future.set_exception(e)

    def drop(self) -> None:
        with _ahead_lock:
            if self not in _ahead:
                return  # a run took it: that run closes it
            _ahead.remove(self)
        with contextlib.suppress(BaseException):
            self.future.result()
        self.stack.close()


_ahead: list[Ahead] = []
_ahead_lock = threading.Lock()


def _take_ahead(cluster: ClusterConfig, scaling: ScalingConfig) -> Ahead | None:
    key = (cluster.n_workers, scaling.max_workers)
    with _ahead_lock:
        for ahead in _ahead:
            if ahead.key == key:
                _ahead.remove(ahead)
                return ahead
    return None


@contextlib.contextmanager
def dask_client(cluster: ClusterConfig, scaling: ScalingConfig) -> Iterator[Client]:
    """A client for the run; a cluster started here (or ahead, for this run) is closed on exit."""
    with contextlib.ExitStack() as stack:
        if not cluster.is_default_local:  # a cluster class, a live cluster, an address
            stack.enter_context(dask.config.set(DASK_SETTINGS))
            stack.enter_context(_quiet_dask())
            client = stack.enter_context(user_client(cluster))
        else:
            ahead = None if scaling.use_gpu else _take_ahead(cluster, scaling)
            if ahead is not None:
                stack.enter_context(ahead.stack)  # its settings and its close, now the run's
                local = ahead.future.result()
            else:
                local = stack.enter_context(_local_cluster(cluster, scaling))
            client = stack.enter_context(Client(local, set_as_default=False))
        yield client
