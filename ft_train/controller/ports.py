"""What the controller needs from the cluster, as narrow interfaces: a test drives the
controller with a fake cluster and fake groups (tests/fake_cluster.py), one transition at a time,
without Dask; `ft_train.driver.worker_group.DaskCluster` is the real one."""

from __future__ import annotations

import queue
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol import GroupEvent
from ..snapshots.piece import SnapshotPiece, SnapshotRound
from ..storage.fs import Storage
from ..storage.run_state import FailureKind


@dataclass
class GroupPlan:
    """What every worker group of a run is started with."""

    train_loop: str | Callable
    config: dict[str, Any]
    name: str
    storage: Storage
    min_workers: int
    max_workers: int
    use_gpu: bool
    start_timeout_s: float  # ScalingConfig.worker_start_timeout_s
    collective_timeout_s: float  # FailureConfig.collective_timeout_s
    agreement_interval_s: float  # FailureConfig.agreement_interval_s
    elastic_wait_s: float  # ScalingConfig.elastic_wait_s
    warm: tuple[str, ...] = ()  # modules each worker imports beyond torch (ClusterConfig.preload)
    snapshot_every: int | None = None  # CheckpointConfig.snapshot_every


class Group(Protocol):
    """One attempt's ranks. Everything that happens to them arrives on the controller's queue
    as a `protocol.GroupEvent` of this attempt."""

    attempt: int
    attempt_id: str
    addresses: list[str]  # the workers, in rank order

    def place(self, plan: GroupPlan, exclude: set[str]) -> None:
        """Wait for the group's workers (`addresses`), before the round to restore is chosen:
        a snapshot holder lost meanwhile is not chosen."""
        ...

    def start(
        self,
        plan: GroupPlan,
        checkpoint_dir: str | None,
        start_report_index: int,
        snapshot: SnapshotRound | None = None,
    ) -> None:
        """Start a rank on each placed worker (`snapshot`: the round they restore from)."""
        ...

    def stop(self, grace_s: float = 0.0, kill_first: Collection[str] = ()) -> set[str]:
        """Stop every rank; the workers killed or lost (not to be used again)."""
        ...

    def read_journals(self, skip: Collection[str] = ()) -> dict[int, dict[str, Any]]: ...

    def request_stop(self) -> None: ...

    def give_notice(self, address: str, deadline: float) -> None: ...

    def release(self) -> None: ...

    def lost_kind(self, address: str) -> FailureKind:
        """PROCESS_DEATH or NODE_LOSS, for a worker the scheduler let go."""
        ...


class Cluster(Protocol):
    def new_group(self, attempt: int, events: queue.Queue[GroupEvent], run_uri: str) -> Group: ...

    def alive(self) -> set[str]:
        """The workers the scheduler lists now."""
        ...

    def can_grow(self, plan: GroupPlan, current: list[str], exclude: set[str]) -> bool: ...

    def watch_preemption(self, notice_s: float) -> None:
        """Give every worker (and those that join later) its preemption watcher."""
        ...

    def warm(self, modules: tuple[str, ...]) -> None:
        """Have every worker import `modules` (in the background)."""
        ...

    def hold_snapshots(self) -> None:
        """Have every worker's nanny (and those that join later) hold snapshot pieces."""
        ...

    def held_snapshots(self, run_uri: str) -> list[SnapshotPiece]:
        """The snapshot pieces held for the run, a copy each, as their holders describe them
        (`ft_train.snapshots.holders`)."""
        ...

    def drop_snapshots(self, run_uri: str) -> None: ...
