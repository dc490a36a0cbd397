"""A fake cluster and fake worker groups (`ft_train.controller.ports`), for driving the controller
one transition at a time without Dask or torch. A test plays the ranks: it puts their events on
the controller's queue (`FakeGroup.report`, `.raised`, `.lost`, ...) and steps the controller."""

from __future__ import annotations

import queue
from collections.abc import Callable, Collection
from typing import Any

from ft_train.controller.ports import GroupPlan
from ft_train.errors import RankFailure
from ft_train.protocol import (
    GroupEvent,
    PreemptNotice,
    RankEnded,
    Report,
    Reported,
    Started,
    WorkerLost,
)
from ft_train.snapshots.piece import SnapshotPiece


class FakeGroup:
    def __init__(self, cluster: FakeCluster, attempt: int, events: queue.Queue[GroupEvent]):
        self.cluster, self.attempt, self.events = cluster, attempt, events
        self.attempt_id = f"{attempt:08d}" + "0" * 24
        self.addresses: list[str] = []
        self.started_from: tuple[str | None, int] | None = None
        self.stopped = self.released = self.stop_requested = False
        self.killed: set[str] = set()
        self.notices: list[tuple[str, float]] = []
        self.journals: dict[int, dict[str, Any]] = {}  # what read_journals returns
        self.journal_skips: list[set[str]] = []

    # -- the Group protocol ----------------------------------------------------------------------

    def place(self, plan, exclude) -> None:
        usable = [w for w in self.cluster.workers if w not in exclude]
        self.addresses = usable[: plan.max_workers]
        self.cluster.while_placing()

    def start(self, plan, checkpoint_dir, start_report_index, snapshot=None) -> None:
        self.started_from = (checkpoint_dir, start_report_index)
        self.snapshot = snapshot

    def stop(self, grace_s: float = 0.0, kill_first: Collection[str] = ()) -> set[str]:
        self.stopped = True
        self.killed |= set(kill_first)
        return set(kill_first) | (set(self.addresses) - self.cluster.alive())

    def read_journals(self, skip: Collection[str] = ()) -> dict[int, dict[str, Any]]:
        self.journal_skips.append(set(skip))
        return self.journals

    def request_stop(self) -> None:
        self.stop_requested = True

    def give_notice(self, address: str, deadline: float) -> None:
        self.notices.append((address, deadline))

    def release(self) -> None:
        self.released = True

    def lost_kind(self, address: str) -> str:
        return self.cluster.lost_kinds.get(address, "process_death")

    # -- what the test's ranks do ----------------------------------------------------------------

    def joined(self, *ranks: int) -> FakeGroup:
        for rank in ranks or range(len(self.addresses)):
            self.events.put(Reported(self.attempt, Started(rank)))
        return self

    def report(self, index: int, ranks=None, checkpoint: bool = False, **metrics) -> FakeGroup:
        """Every rank's (or `ranks`') report `index`, each with a checkpoint file if asked."""
        for rank in range(len(self.addresses)) if ranks is None else ranks:
            dir_name = (
                f"checkpoint_{index:06d}-a{self.attempt}-{self.attempt_id[:8]}"
                if checkpoint
                else None
            )
            files = {f"rank{rank}.pt": {"size": 1, "sha256": "0"}} if checkpoint else {}
            msg = Report(rank, index, {"step": index, **metrics}, dir_name, files)
            self.events.put(Reported(self.attempt, msg))
        return self

    def preempted_at(
        self, index: int, leaving: tuple[int, ...], deadline: float, checkpoint: bool
    ) -> None:
        """Report `index`, at which every rank learned that `leaving` go by `deadline`."""
        for rank in range(len(self.addresses)):
            dir_name = f"checkpoint_{index:06d}-a{self.attempt}-x" if checkpoint else None
            files = {f"rank{rank}.pt": {"size": 1, "sha256": "0"}} if checkpoint else {}
            msg = Report(rank, index, {"step": index}, dir_name, files, leaving, deadline)
            self.events.put(Reported(self.attempt, msg))

    def returned(self, reports: int, ranks=None, stopped: bool = False) -> FakeGroup:
        for rank in range(len(self.addresses)) if ranks is None else ranks:
            summary = {"rank": rank, "reports": reports, **({"stopped": True} if stopped else {})}
            self.events.put(RankEnded(self.attempt, rank, summary=summary))
        return self

    def raised(
        self, rank: int, error: str, step: int, fatal: bool = False, damaged: str | None = None
    ) -> FakeGroup:
        failure = RankFailure(rank, step, error, "Traceback: ...", fatal, damaged)
        self.events.put(RankEnded(self.attempt, rank, error=failure))
        return self

    def ended(self, rank: int, **how) -> FakeGroup:
        self.events.put(RankEnded(self.attempt, rank, **how))
        return self

    def lost(self, rank: int, expected: bool = False) -> FakeGroup:
        self.cluster.workers.remove(self.addresses[rank])
        self.events.put(WorkerLost(self.attempt, self.addresses[rank], expected))
        return self

    def notice(self, rank: int, deadline: float) -> FakeGroup:
        self.events.put(PreemptNotice(self.attempt, self.addresses[rank], deadline))
        return self


class FakeCluster:
    def __init__(self, workers: int = 3):
        self.workers = [f"tcp://w{i}:1" for i in range(workers)]
        self.groups: list[FakeGroup] = []
        self.lost_kinds: dict[str, str] = {}
        self.grow = False  # what can_grow answers
        self.watching: list[float] = []
        self.warmed: list[tuple[str, ...]] = []
        self.snapshots: list[SnapshotPiece] = []  # the pieces held_snapshots answers
        self.while_placing: Callable[[], Any] = lambda: None  # what happens as a group waits

    @property
    def group(self) -> FakeGroup:
        return self.groups[-1]

    def new_group(self, attempt: int, events: queue.Queue[GroupEvent], run_uri: str) -> FakeGroup:
        self.groups.append(FakeGroup(self, attempt, events))
        return self.groups[-1]

    def alive(self) -> set[str]:
        return set(self.workers)

    def can_grow(self, plan, current, exclude) -> bool:
        return self.grow

    def watch_preemption(self, notice_s: float) -> None:
        self.watching.append(notice_s)

    def warm(self, modules: tuple[str, ...]) -> None:
        self.warmed.append(modules)

    def hold_snapshots(self) -> None:
        pass

    def held_snapshots(self, run_uri: str) -> list[SnapshotPiece]:
        return list(self.snapshots)

    def drop_snapshots(self, run_uri: str) -> None:
        self.snapshots = []


def fake_plan(
    storage, name: str = "run", ranks: int = 2, min_workers: int | None = None
) -> GroupPlan:
    """A group plan for a controller on the fake cluster: `ranks` ranks (at least `min_workers`,
    an elastic group), a train loop no fake group runs."""
    return GroupPlan(
        train_loop="x:y",
        config={},
        name=name,
        storage=storage,
        min_workers=min(ranks, ranks if min_workers is None else min_workers),
        max_workers=ranks,
        use_gpu=False,
        start_timeout_s=1.0,
        collective_timeout_s=1800.0,
        agreement_interval_s=0.0,
        elastic_wait_s=0.0,
    )
