"""What crosses between a rank and the driver: its messages, the worker group's events, and the
flags of the ranks' agreement. Frozen dataclasses, each with its wire form.

Rank -> driver (a Dask event batch, and the rank's journal; `wire()` / `message()`):

    Started        the rank joined its process group (the hang watchdog starts)
    Report         its k-th report(): metrics, and the checkpoint files it attached
    UploadIntent   (journal only) an asynchronous upload of round k's files has begun

Worker group -> controller (one queue, `ft_train.driver.worker_group`):

    Reported, RankEnded, WorkerLost, PreemptNotice; and LeaseLost from the run's lease
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "index": self.index, "metrics": self.metrics}
        if self.dir_name is not None:
            out["dir_name"], out["files"] = self.dir_name, self.files
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
    """What `ft_train.get_preemption_info()` returns once the group has been given notice."""

    ranks: tuple[int, ...]  # the ranks whose workers are leaving
    deadline: float  # epoch seconds by which the first of them leaves


@dataclass(frozen=True)
class Agreement:
    """What every rank learns at the same report(), from one all-reduce (MAX) of `flags`."""

    preemption: PreemptionInfo | None
    stop: bool  # the driver asked the group to stop
    any_finished: bool  # some rank has returned from its training function
    all_finished: bool
    every: int  # the next agreement starts this many reports later
    same_index: bool  # every rank started it at the same report index


def encode_flags(
    rank: int,
    world_size: int,
    deadline: float | None,
    stop: bool,
    finished: bool,
    every: int,
    index: int,
) -> list[float]:
    """One rank's flags. Reduced with MAX: a slot per rank (its worker has notice), then the
    negated earliest deadline, stop, finished (any), not finished (any), the largest `every`,
    and the index both ways (the highest, and the negated lowest)."""
    w = world_size
    flags = [0.0] * (w + 7)  # a list first: a tensor's item assignments cost ~10 us each
    flags[w] = float("-inf") if deadline is None else -deadline
    if deadline is not None:
        flags[rank] = 1.0
    flags[w + 1] = 1.0 if stop else 0.0
    flags[w + 2] = 1.0 if finished else 0.0
    flags[w + 3] = 0.0 if finished else 1.0
    flags[w + 4] = float(every)
    flags[w + 5], flags[w + 6] = float(index), -float(index)
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
        same_index=flags[w + 5] == -flags[w + 6],
    )
