"""What crosses between a rank and the driver: its messages, the worker group's events, and the
flags of the ranks' agreement. Frozen dataclasses, each with its wire form.

Rank -> driver (a Dask event batch, and the rank's journal; `wire()` / `message()`):

    Started        the rank joined its process group (the hang watchdog starts)
    Report         its k-th report(): metrics, and the checkpoint files it attached
    UploadIntent   (journal only) an asynchronous upload of round k's files has begun

Worker group -> controller (one queue, `ft_train.driver.worker_group`):

    Reported, RankEnded, WorkerLost, PreemptNotice; and LeaseLost from the run's lease

Driver -> rank: `RankSpec`, sent with the rank's Dask task (pickled, not a wire form of ours).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .snapshots.piece import SnapshotRound

if TYPE_CHECKING:  # a type only: the storage never imports the wire types, nor they it
    from .storage.fs import Storage

FileInfo = dict[str, Any]  # size, sha256; "at": a side path (storage.fs.upload_dir)


@dataclass(frozen=True)
class Started:
    rank: int

    def wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "started": True}


@dataclass(frozen=True)
class Report:
    rank: int
    index: int
    metrics: dict[str, Any] = field(default_factory=dict)
    dir_name: str | None = None  # the round's checkpoint directory, if this rank attached
    files: dict[str, FileInfo] = field(default_factory=dict)
    preempted: tuple[int, ...] | None = None  # learned at this report: these ranks leave
    deadline: float | None = None  # by then (epoch seconds)
    # report(checkpoint_dir_name=...), with or without a checkpoint: the driver checks that the
    # ranks of a round agree on it (`controller.Controller._on_round`)
    label: str | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "index": self.index, "metrics": self.metrics}
        if self.dir_name is not None:
            out["dir_name"], out["files"] = self.dir_name, self.files
        if self.label is not None:
            out["label"] = self.label
        if self.preempted is not None:
            out["preempted"], out["deadline"] = list(self.preempted), self.deadline
        return out


@dataclass(frozen=True)
class UploadIntent:
    rank: int
    index: int
    dir_name: str

    def wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "index": self.index,
            "dir_name": self.dir_name,
            "upload": "pending",
        }


Message = Started | Report | UploadIntent


def message(d: dict[str, Any]) -> Message:
    """A message from its wire form."""
    if d.get("started"):
        return Started(d["rank"])
    if d.get("upload") == "pending":
        return UploadIntent(d["rank"], d["index"], d["dir_name"])
    preempted = d.get("preempted")
    return Report(
        rank=d["rank"],
        index=d["index"],
        metrics=d.get("metrics", {}),
        dir_name=d.get("dir_name"),
        files=d.get("files") or {},
        preempted=None if preempted is None else tuple(preempted),
        deadline=d.get("deadline"),
        label=d.get("label"),
    )


# -- the worker group's events -------------------------------------------------------------------


@dataclass(frozen=True)
class Reported:
    attempt: int
    message: Message


@dataclass(frozen=True)
class RankEnded:
    """A rank's Dask task ended: with its summary, an error, or cancelled (its worker gone)."""

    attempt: int
    rank: int
    summary: dict[str, Any] | None = None  # {"rank", "reports", "stopped"?}
    error: BaseException | None = None  # a RankFailure, or what Dask raised
    cancelled: bool = False
    worker_died: bool = False  # Dask's KilledWorker: the rank's process died under it


@dataclass(frozen=True)
class WorkerLost:
    attempt: int
    address: str
    expected: bool  # retired or closed on purpose (Client.retire_workers)


@dataclass(frozen=True)
class PreemptNotice:
    attempt: int
    address: str
    deadline: float


@dataclass(frozen=True)
class LeaseLost:
    why: str
    attempt: int | None = None


GroupEvent = Reported | RankEnded | WorkerLost | PreemptNotice | LeaseLost


# -- the agreement's flags -----------------------------------------------------------------------


@dataclass(frozen=True)
class PreemptionInfo:
    """What `ft_train.get_preemption_info()` returns once the group has been given notice.

    `ranks` and `deadline` are ft-train's; `preempted_ranks` and `deadline_ms` are the same
    facts under Ray Train's names. `reported`: this rank has called report() since the call that
    first returned the notice (the same call on every rank), so a loop can tell that its
    just-in-time report is done."""

    ranks: tuple[int, ...]  # the ranks whose workers are leaving
    deadline: float  # epoch seconds by which the first of them leaves
    reported: bool = False

    @property
    def preempted_ranks(self) -> list[int]:
        """Ray's name: the leaving ranks, ascending."""
        return sorted(self.ranks)

    @property
    def deadline_ms(self) -> int:
        """Ray's name: the deadline in epoch milliseconds."""
        return int(self.deadline * 1000)


class Point(enum.IntEnum):
    """What a rank was doing at an agreement point (`ft_train.worker.session`): every rank
    must pass the same points in the same order."""

    REPORT = 1
    POLL = 2  # get_preemption_info()
    BARRIER = 3  # ft_train.collective.barrier()
    BROADCAST = 4  # ft_train.collective.broadcast_from_rank_zero()
    FINISH = 5  # the training function returned

    def call(self) -> str:
        return _CALLS[self]


_CALLS = {
    Point.REPORT: "report()",
    Point.POLL: "get_preemption_info()",
    Point.BARRIER: "ft_train.collective.barrier()",
    Point.BROADCAST: "ft_train.collective.broadcast_from_rank_zero()",
    Point.FINISH: "the return from the training function",
}


@dataclass(frozen=True)
class Agreement:
    """What every rank learns at the same agreement point, from one all-reduce (MAX) of `flags`."""

    preemption: PreemptionInfo | None
    stop: bool  # the driver asked the group to stop
    any_finished: bool  # some rank has returned from its training function
    all_finished: bool
    every: int  # the next agreement starts this many points later
    same_index: bool  # every rank started it at the same point (index, kind and report count)
    payload: int = 0  # rank 0's: a broadcast's size in bytes plus one, 0 if it has none


def encode_flags(
    rank: int,
    world_size: int,
    deadline: float | None,
    stop: bool,
    finished: bool,
    every: int,
    index: int,
    kind: int = 0,
    reports: int = 0,
    payload: int = 0,
) -> list[float]:
    """One rank's flags. Reduced with MAX: a slot per rank (its worker has notice), then the
    negated earliest deadline, stop, finished (any), not finished (any), the largest `every`,
    the point's index, kind (`Point`) and report count, each both ways (the highest, and the
    negated lowest: equal on every rank if they agree), and rank 0's `payload`."""
    w = world_size
    flags = [0.0] * (w + 12)  # a list first: a tensor's item assignments cost ~10 us each
    flags[w] = float("-inf") if deadline is None else -deadline
    if deadline is not None:
        flags[rank] = 1.0
    flags[w + 1] = 1.0 if stop else 0.0
    flags[w + 2] = 1.0 if finished else 0.0
    flags[w + 3] = 0.0 if finished else 1.0
    flags[w + 4] = float(every)
    flags[w + 5], flags[w + 6] = float(index), -float(index)
    flags[w + 7], flags[w + 8] = float(kind), -float(kind)
    flags[w + 9], flags[w + 10] = float(reports), -float(reports)
    flags[w + 11] = float(payload)
    return flags


def decode_flags(flags: list[float], world_size: int) -> Agreement:
    """The agreement, from the reduced flags."""
    w = world_size
    ranks = tuple(r for r in range(w) if flags[r])
    info = PreemptionInfo(ranks, -flags[w]) if ranks else None
    return Agreement(
        info,
        bool(flags[w + 1]),
        bool(flags[w + 2]),
        not flags[w + 3],
        every=int(flags[w + 4]),
        same_index=all(flags[w + i] == -flags[w + i + 1] for i in (5, 7, 9)),
        payload=int(flags[w + 11]),
    )


@dataclass
class RankSpec:
    """Everything one rank needs, sent by the driver with the rank's Dask task."""

    train_loop: str | Callable
    config: dict[str, Any]
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    name: str
    attempt: int
    attempt_id: str
    master_addr: str
    master_port: int
    backend: str
    use_gpu: bool
    storage: Storage
    checkpoint_dir: str | None  # latest committed checkpoint, None on a fresh run
    start_report_index: int
    topic: str
    collective_timeout_s: float  # FailureConfig.collective_timeout_s
    agreement_interval_s: float  # FailureConfig.agreement_interval_s
    snapshot_every: int | None = None  # CheckpointConfig.snapshot_every
    snapshot_holders: tuple[str, ...] = ()  # who hold its snapshots (`ft_train.snapshots`)
    snapshot: SnapshotRound | None = None  # the snapshot round to restore, chosen by the driver
