"""Clusters the user names, in prefect-dask's conventions: a cluster class ft-train starts for the
run and closes at its end (`cluster_class`, `cluster_kwargs`, `adapt_kwargs`: SLURM through
dask-jobqueue, Kubernetes through dask-kubernetes, ...), a live cluster object the caller owns,
or a running scheduler's `address`; and the run's Client to it (`client_kwargs`: TLS).

A cluster class is started under ft-train's Dask settings (`dask_settings`, entered by the
caller): its scheduler runs in the driver's process and reads them when it starts, so it never
re-runs a rank whose worker died; its workers read them from the file `ft-train dask-config`
prints. A live cluster or an address is the user's: its scheduler and workers must have been
started with them (docs/clusters.md); the run says which settings they lack.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask
from distributed import Client
from distributed.deploy import Cluster

from ..cluster_config import ClusterConfig
from ..errors import ConfigError
from .dask_settings import warn_if_not_in_force
from .job_queue import JobReplacer, is_job_queue

logger = logging.getLogger("ft_train")


def load_cluster_class(cfg: ClusterConfig) -> Callable[..., Any]:
    """`cfg.cluster_class` imported ('package.module.Class' or 'package.module:Class'), and its
    `cluster_kwargs` checked against its signature: ConfigError naming the field and the fix,
    before anything starts."""
    path = cfg.cluster_class
    assert path is not None
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name:
        raise ConfigError(
            f"cluster.cluster_class {path!r} is not an import path; give one like "
            "'dask_jobqueue.SLURMCluster' or 'distributed.LocalCluster'"
        )
    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"cluster.cluster_class {path!r} cannot be imported ({type(e).__name__}: {e}); "
            "install its package in the driver's environment (e.g. pip install dask-jobqueue) "
            "or check the name"
        ) from None
    if not callable(found):
        raise ConfigError(
            f"cluster.cluster_class {path!r} is a {type(found).__name__}, not a cluster class "
            "or factory; give a class like 'dask_jobqueue.SLURMCluster'"
        )
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # no signature: the call itself will tell
        return found
    try:
        signature.bind(**cfg.cluster_kwargs)
    except TypeError as e:
        raise ConfigError(
            f"cluster.cluster_kwargs do not fit {path}{signature}: {e}; fix cluster_kwargs"
        ) from None
    return found


@contextlib.contextmanager
def _started(cfg: ClusterConfig) -> Iterator[Cluster]:
    """The cluster `cfg.cluster_class` makes, adapted if asked, closed on exit."""
    make = load_cluster_class(cfg)
    cluster = make(**cfg.cluster_kwargs)
    if not isinstance(cluster, Cluster):
        with contextlib.suppress(Exception):  # not ours to know how to close: try
            cluster.close()
        raise ConfigError(
            f"cluster.cluster_class {cfg.cluster_class!r} made a {type(cluster).__name__}, not a "
            "distributed cluster (distributed.deploy.Cluster); give a cluster class"
        )
    with cluster:
        if cfg.adapt_kwargs:
            cluster.adapt(**cfg.adapt_kwargs)
        replacer = JobReplacer(cluster).start() if is_job_queue(cluster) else None
        try:
            yield cluster
        finally:
            if replacer is not None:
                replacer.stop()


@contextlib.contextmanager
def user_client(cfg: ClusterConfig) -> Iterator[Client]:
    """A client for the run to the cluster `cfg` names (not the default local one). A cluster
    started from `cluster_class` is closed on exit; a live cluster and an address are left as
    they were."""
    kwargs = {**cfg.client_kwargs, "set_as_default": False}
    with contextlib.ExitStack() as stack:
        target: str | Cluster
        if cfg.address is not None:
            target = cfg.address
        elif cfg.cluster is not None:
            target = cfg.cluster
        else:
            target = stack.enter_context(_started(cfg))
        try:
            client = Client(target, **kwargs)
        except TypeError as e:
            raise ConfigError(f"cluster.client_kwargs: {e}; fix client_kwargs") from None
        stack.enter_context(client)
        warn_if_not_in_force(client)
        yield client


def check_scheduler(cluster: ClusterConfig) -> None:
    """Is `cluster.address` a Dask scheduler that answers? Asked before the run's storage is
    touched, so that a wrong address fails with nothing written. Waits up to Dask's connect
    timeout (`distributed.comm.timeouts.connect`)."""
    if cluster.address is None:
        return
    from dask.utils import parse_timedelta
    from distributed import Security
    from distributed.comm import connect

    timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")

    security = cluster.client_kwargs.get("security") or Security()  # tls:// needs its context
    args = security.get_connection_args("client")

    async def probe() -> None:
        comm = await connect(cluster.address, timeout=timeout, **args)
        await comm.close()

    with ThreadPoolExecutor(1) as pool:  # its own event loop, whatever runs in this thread
        try:
            pool.submit(asyncio.run, probe()).result()
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(
                f"cluster.address {cluster.address!r}: no Dask scheduler answered within "
                f"{timeout:g}s ({type(e).__name__}: {e}); check the address and that the "
                "scheduler runs, or leave cluster.address unset to start a local cluster"
            ) from None
