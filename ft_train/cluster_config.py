"""ClusterConfig: which Dask cluster the ranks run on, in prefect-dask's `DaskTaskRunner`
conventions (`address`, `cluster_class` + `cluster_kwargs` + `adapt_kwargs`, `client_kwargs`, and a
live cluster object in a Python call). Validated here, before anything starts; built by
`ft_train.driver.cluster` (local) and `ft_train.driver.user_cluster` (the others).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterConfig(_Config):
    """Where the ranks run, in prefect-dask's `DaskTaskRunner` conventions: a local Dask cluster
    started for the run (the default), a cluster class ft-train starts and stops
    (`cluster_class`, `cluster_kwargs`, `adapt_kwargs`), an existing scheduler (`address`), or,
    in a Python call only, a live `distributed` cluster object (`cluster`)."""

    address: str | None = Field(
        None,
        description="Scheduler address of an existing Dask cluster: tcp://host:8786, tls://..., "
        "or a bare host:port (tcp). None starts a cluster for the run and stops it at the end.",
    )
    cluster_class: str | None = Field(
        None,
        description="Import path of a Dask cluster class (or factory) ft-train starts for the run "
        "and closes at its end, e.g. 'dask_jobqueue.SLURMCluster'; None: a local cluster sized "
        "to the run. In a Python call the class itself is accepted too.",
    )
    cluster_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for cluster_class, e.g. {'cores': 8, 'walltime': '4:00:00'}.",
    )
    adapt_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="If given, cluster.adapt(**adapt_kwargs) on the cluster_class cluster, e.g. "
        "{'minimum': 4, 'maximum': 8}; empty: no adaptive scaling (scale it in cluster_kwargs).",
    )
    client_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        description="Keyword arguments for the run's distributed.Client, e.g. "
        "{'security': Security(...)} for TLS (a Python call; not stored by Prefect).",
    )
    cluster: Any = Field(
        None,
        repr=False,
        description="A live distributed cluster object (LocalCluster, SLURMCluster, ...), in a "
        "Python call only; ft-train uses it and leaves it running. Not JSON: a deployment "
        "gives address or cluster_class instead.",
    )
    n_workers: int | None = Field(
        None,
        ge=1,
        description="Workers of the local cluster; default: scaling_config.num_workers (its "
        "max), plus one warm spare on CPU that takes a failed rank's place at once. "
        "Ignored with `address`.",
    )

    preload: tuple[str, ...] = Field(
        (),
        description="Modules every worker imports before it runs a rank, beyond torch: the "
        "training function's own heavy imports (e.g. 'sklearn.datasets'). A local cluster's fork "
        "server imports them once, so the fresh processes that replace a failed group's have "
        "them at once; an existing cluster's workers import them as they join.",
    )

    @model_validator(mode="before")
    @classmethod
    def _a_live_cluster_alone(cls, value: Any) -> Any:
        """`cluster=LocalCluster(...)` given as the flow's whole `cluster` parameter."""
        from distributed.deploy import Cluster

        return {"cluster": value} if isinstance(value, Cluster) else value

    @field_validator("address")
    @classmethod
    def _address_is_a_url(cls, address: str | None) -> str | None:
        if address is None:
            return None
        if "://" not in address:
            if not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}", address):
                raise ValueError(
                    f"cluster.address {address!r} must be a scheduler URL like tcp://host:8786 "
                    "(or a bare host:port)"
                )
            address = "tcp://" + address
        return address

    @field_validator("cluster_class", mode="before")
    @classmethod
    def _class_as_path(cls, value: Any) -> Any:
        """A class or factory (a Python call) becomes its import path, so that the config stays
        JSON (a flow parameter); one that cannot be imported back by that path is refused."""
        if value is None or isinstance(value, str) or not callable(value):
            return value
        path = f"{value.__module__}.{value.__qualname__}"
        if "<" in path:
            raise ValueError(
                f"cluster.cluster_class {value!r} cannot be imported by name ({path}); define "
                "it at a module's top level, or pass a live cluster as cluster.cluster"
            )
        return path

    @field_validator("cluster")
    @classmethod
    def _live_cluster(cls, value: Any) -> Any:
        from distributed.deploy import Cluster

        if value is None or isinstance(value, Cluster):
            return value
        if isinstance(value, str):  # what a live cluster became in a stored flow parameter
            raise ValueError(
                f"cluster.cluster {value!r}: a live cluster object can be passed only in a "
                "Python call of the flow, not through a deployment or a stored flow run's "
                "parameters (they are JSON); give cluster.address (its scheduler's address) or "
                "cluster.cluster_class and cluster.cluster_kwargs instead"
            )
        raise ValueError(
            f"cluster.cluster: {type(value).__name__} is not a distributed cluster "
            "(distributed.deploy.Cluster: LocalCluster, SLURMCluster, ...); for a scheduler's "
            "address use cluster.address"
        )

    @field_serializer("cluster")
    def _cluster_as_text(self, value: Any) -> str | None:
        return None if value is None else f"<live {type(value).__name__}: Python calls only>"

    @field_serializer("client_kwargs", "cluster_kwargs")
    def _no_secrets(self, value: dict[str, Any]) -> dict[str, Any]:
        """A Security object holds TLS keys (Security.temporary(): the key itself): never in a
        stored flow parameter."""
        return {k: v if k != "security" else "<Security: not stored>" for k, v in value.items()}

    @model_validator(mode="after")
    def _one_way_to_the_cluster(self) -> ClusterConfig:
        given = [n for n in ("address", "cluster", "cluster_class") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join('cluster.' + n for n in given)} are both set; give one "
                "way to the cluster: address (a running scheduler), cluster (a live cluster "
                "object), or cluster_class with cluster_kwargs (a cluster ft-train starts)"
            )
        if self.cluster_class is None:
            for name in ("cluster_kwargs", "adapt_kwargs"):
                if getattr(self, name):
                    raise ValueError(
                        f"cluster.{name} is set without cluster.cluster_class: it applies only to "
                        "a cluster ft-train starts from cluster_class; set cluster_class, or "
                        f"remove {name} (with address or cluster, configure that cluster itself)"
                    )
        if self.n_workers is not None and (self.cluster_class or self.cluster is not None):
            raise ValueError(
                "cluster.n_workers sizes the local cluster ft-train starts by default; with "
                "cluster_class put the size in cluster_kwargs or adapt_kwargs, with a live "
                "cluster scale it yourself"
            )
        for name in ("cluster_kwargs", "client_kwargs"):
            if "asynchronous" in getattr(self, name):
                raise ValueError(
                    f"cluster.{name}: 'asynchronous' is not allowed (the driver uses the "
                    "cluster and client synchronously); remove it"
                )
        return self

    @property
    def is_default_local(self) -> bool:
        """The local cluster ft-train sizes and starts itself (no address, class or object)."""
        return self.address is None and self.cluster is None and self.cluster_class is None

    @field_validator("preload")
    @classmethod
    def _module_names(cls, modules: tuple[str, ...]) -> tuple[str, ...]:
        for i, module in enumerate(modules):
            if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module):
                raise ValueError(
                    f"cluster.preload[{i}] {module!r} is not a module name: give dotted names "
                    "like 'sklearn.datasets'"
                )
        return modules

    @model_validator(mode="after")
    def _preload_is_installed(self) -> ClusterConfig:
        """On a local cluster the workers import what the driver can: a module that is not
        installed here would be skipped by them without a word. (Not asked of an existing
        cluster, whose workers may have other packages.)"""
        if self.is_default_local:
            for i, module in enumerate(self.preload):
                package = module.split(".")[0]
                if importlib.util.find_spec(package) is None:
                    raise ValueError(
                        f"cluster.preload[{i}] {module!r}: no package {package!r} is installed "
                        "here; install it, or remove it from cluster.preload"
                    )
        return self
