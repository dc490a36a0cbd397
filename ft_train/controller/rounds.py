"""Report rounds: the k-th report() of every rank, consolidated into one.

A round is complete when every rank's k-th report has arrived; it carries rank 0's metrics and
the files of every rank that attached a checkpoint. Rounds complete in index order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Round:
    index: int
    metrics: dict[str, Any]
    dir_name: Optional[str] = None
    files: dict[str, Any] = field(default_factory=dict)
    preempted: Optional[list[int]] = None  # the group learned at this round: these ranks leave
    deadline: Optional[float] = None


class ReportRounds:
    def __init__(self, world_size: int, last_index: int):
        self.world_size = world_size
        self.last_index = last_index  # the last round handed out
        self.pending: dict[int, dict[int, dict]] = {}
        self.received: dict[int, int] = {}  # rank -> highest index received

    def add(self, msg: dict) -> None:
        self.pending.setdefault(msg["index"], {})[msg["rank"]] = msg
        self.received[msg["rank"]] = max(self.received.get(msg["rank"], 0), msg["index"])

    def pop_complete(self) -> Optional[Round]:
        """The next round if every rank has reported it, else None."""
        nxt = self.last_index + 1
        msgs = self.pending.get(nxt)
        if msgs is None or len(msgs) < self.world_size:
            return None
        del self.pending[nxt]
        self.last_index = nxt
        first = msgs.get(0, next(iter(msgs.values())))
        rnd = Round(nxt, first["metrics"], preempted=first.get("preempted"), deadline=first.get("deadline"))
        for rank in sorted(msgs):
            m = msgs[rank]
            if m.get("dir_name"):
                rnd.dir_name = m["dir_name"]
                rnd.files.update(m["files"])
        return rnd
