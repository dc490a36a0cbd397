"""Report rounds: the k-th report() of every rank, consolidated into one.

A round is complete when every rank's k-th report has arrived; it carries rank 0's metrics and
the files of every rank that attached a checkpoint. Rounds complete in index order. Once a group
has stopped, `recover` finds the newest checkpoint round every rank reached from their journals.

Files of the same name from several ranks (DESIGN.md, storage invariant 3): the lowest rank's
file is the round's, whichever rank's upload finished first. Its entry in `Round.files` keeps
the rank's `"at"` (its bytes are at a side path: `ft_train.storage.fs`) and gains `"ranks"`, the
ranks that attached the name; the commit (`CheckpointManager.commit`) moves the bytes into place
and lists only size and sha256. `collision_warning` says what was discarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol import FileInfo, Report, UploadIntent, message


@dataclass
class Round:
    index: int
    metrics: dict[str, Any]
    dir_name: str | None = None
    files: dict[str, FileInfo] = field(default_factory=dict)
    preempted: tuple[int, ...] | None = None  # the group learned at this round: these leave
    deadline: float | None = None
    # report(checkpoint_dir_name=...) of each rank that attached files or passed a name
    labels: dict[int, str | None] = field(default_factory=dict)
    # every rank's metrics, in rank order (Ray's `UserCallback.after_report` hands them all)
    rank_metrics: list[dict[str, Any]] = field(default_factory=list)


class ReportRounds:
    def __init__(self, world_size: int, last_index: int):
        self.world_size = world_size
        self.last_index = last_index  # the last round handed out
        self.pending: dict[int, dict[int, Report]] = {}
        self.received: dict[int, int] = {}  # rank -> highest index received

    def add(self, msg: Report) -> None:
        self.received[msg.rank] = max(self.received.get(msg.rank, 0), msg.index)
        if msg.index > self.last_index:  # else a journal's copy of a round handed out
            self.pending.setdefault(msg.index, {})[msg.rank] = msg

    def pop_complete(self) -> Round | None:
        """The next round if every rank has reported it, else None."""
        nxt = self.last_index + 1
        msgs = self.pending.get(nxt)
        if msgs is None or len(msgs) < self.world_size:
            return None
        del self.pending[nxt]
        self.last_index = nxt
        return _consolidate(nxt, msgs)

    def recover(self, journals: dict[int, dict]) -> Round | None:
        """Once the group has stopped: the newest checkpoint round that every rank reached,
        with every file of it stored, from what reached the driver and what the ranks'
        journals hold (`ft_train.worker.journal`); None if there is none newer than the last round
        handed out. The rounds before it are passed over: none of them is a newer checkpoint.

        A rank whose journal was read reached the highest index it holds, and attached files
        at round k only if its journal has a line for k; an intent (an asynchronous upload)
        without its message leaves round k incomplete. For a rank whose journal is lost (its
        node), only its own message for round k says what it attached."""
        intents: dict[int, set[int]] = {}
        for rank, journal in journals.items():
            if "index" in journal:
                self.received[rank] = max(self.received.get(rank, 0), journal["index"])
            for msg in map(message, journal["messages"]):
                if isinstance(msg, UploadIntent):
                    intents.setdefault(msg.index, set()).add(rank)
                elif isinstance(msg, Report):
                    self.add(msg)
        reached = min(self.received.get(r, self.last_index) for r in range(self.world_size))
        for index in sorted(self.pending, reverse=True):
            msgs = self.pending[index]
            if index > reached or not any(m.dir_name for m in msgs.values()):
                continue
            known = all(r in msgs or r in journals for r in range(self.world_size))
            if known and intents.get(index, set()) <= set(msgs):
                self.pending = {i: m for i, m in self.pending.items() if i > index}
                self.last_index = index
                return _consolidate(index, msgs)
        return None


def _consolidate(index: int, msgs: dict[int, Report]) -> Round:
    """One round from its ranks' messages: rank 0's metrics (the lowest rank's, when a
    recovered round lacks rank 0's), every rank's files; of a name that several ranks attached,
    the lowest rank's file, with `"ranks"` added."""
    first = msgs[min(msgs)]
    rnd = Round(index, first.metrics, preempted=first.preempted, deadline=first.deadline)
    rnd.rank_metrics = [msgs[rank].metrics for rank in sorted(msgs)]
    holders: dict[str, list[int]] = {}
    for rank in sorted(msgs):  # lowest first: the first rank to attach a name keeps it
        m = msgs[rank]
        if m.dir_name or m.label is not None:
            rnd.labels[rank] = m.label
        if m.dir_name:
            rnd.dir_name = m.dir_name
            for rel, info in m.files.items():
                ranks = holders.setdefault(rel, [])
                ranks.append(rank)
                if len(ranks) == 1:
                    rnd.files[rel] = info
    for rel, ranks in holders.items():
        if len(ranks) > 1:
            rnd.files[rel] = {**rnd.files[rel], "ranks": ranks}
    return rnd


def label_conflict(rnd: Round) -> str | None:
    """Why round `rnd` cannot be committed under one name, or None. Each rank puts its files
    into the directory its own `checkpoint_dir_name` names: ranks that disagree would leave one
    round in several directories (and Ray's meaning, rank 0's name for all, needs a broadcast
    that report() does not wait for)."""
    if len(set(rnd.labels.values())) <= 1:
        return None
    given = ", ".join(f"rank {r}: {label!r}" for r, label in sorted(rnd.labels.items()))
    return (
        f"report() {rnd.index}: the ranks passed different checkpoint_dir_name values ({given}); "
        "every rank that attaches a checkpoint or passes a checkpoint_dir_name in a round must "
        "pass the same name (e.g. computed from the epoch or step, the same on every rank)"
    )


def collision_warning(rnd: Round) -> str | None:
    """What a user is told when ranks attached files of the same name in `rnd`, or None."""
    shared = {rel: info["ranks"] for rel, info in rnd.files.items() if "ranks" in info}
    if not shared:
        return None
    which = "; ".join(
        f"{rel!r} by ranks {', '.join(map(str, ranks))}" for rel, ranks in sorted(shared.items())
    )
    return (
        f"checkpoint {rnd.dir_name} (report {rnd.index}): several ranks attached a file of the same "
        f"name: {which}. The lowest rank's file is kept and the others' discarded; to keep every "
        "rank's, give each its own name (e.g. f'state-{rank}.pt'), or attach it from one rank only"
    )
