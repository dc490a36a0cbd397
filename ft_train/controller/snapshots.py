"""Which in-memory snapshot round a restart restores from, if any (`ft_train.worker.snapshots`).

The holders say what they hold (`Cluster.held_snapshots`), each piece's checksum checked again
as they answer. A rank's piece may have two copies, on two holders (`driver.snapshot_holders`):
a piece is held whole when one of its copies is held and matches its sha256. A round is one
attempt's pieces at one report index, never pieces of two attempts. A snapshot round is
complete when every rank of its attempt has its piece held whole; a just-in-time round (saved
by the survivors of a failure) when at least one survivor's piece is, and no survivor's piece
has only damaged copies. The restart takes the newest complete round newer than the latest
checkpoint on storage (a snapshot round before a just-in-time one at the same index), else
storage.

Only the attempts of this driver's current lineage count: the attempt that ran last, and those
before it back to the one that restored from storage. A round of an attempt that a restart from
storage abandoned belongs to another history, even where its holders still answer; and a new
driver starts from storage, as it always has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ft_train")


@dataclass(frozen=True)
class SnapshotRound:
    attempt_id: str
    index: int
    kind: str  # "snapshot" or "jit"
    pieces: tuple[dict[str, Any], ...]  # every whole copy, by rank: holder, rank, sha256, ...

    def spec(self) -> dict[str, Any]:
        """What each rank of the next group is started with (`RankSpec.snapshot`)."""
        return {"attempt_id": self.attempt_id, "index": self.index, "pieces": list(self.pieces)}

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index} of attempt {self.attempt_id[:8]}"


def complete_rounds(held: list[dict[str, Any]]) -> list[SnapshotRound]:
    """Every complete round in `held` (the holders' answers, a copy each), newest first."""
    by_round: dict[tuple[str, int, str], dict[int, list[dict[str, Any]]]] = {}
    for p in held:
        key = (p["attempt_id"], p["index"], p["kind"])
        by_round.setdefault(key, {}).setdefault(p["rank"], []).append(p)
        if not p["ok"]:
            logger.warning(
                "ft-train: %s %d of rank %d is damaged on %s",
                *(p["kind"], p["index"], p["rank"], p["holder"]),
            )
    rounds = []
    for (attempt_id, index, kind), copies in by_round.items():
        whole = {r: [p for p in ps if p["ok"]] for r, ps in copies.items()}
        ranks = {r for r, ps in whole.items() if ps}  # those whose piece is held whole
        world = max(p["world_size"] for ps in copies.values() for p in ps)
        if ranks == set(range(world)) or (kind == "jit" and ranks == set(copies)):
            ordered = tuple(p for r in sorted(ranks) for p in whole[r])
            rounds.append(SnapshotRound(attempt_id, index, kind, ordered))
    return sorted(rounds, key=lambda r: (r.index, r.kind == "snapshot"), reverse=True)


@dataclass
class SnapshotTier:
    """The controller's view: the lineage of attempts whose rounds a restart may take, and the
    rounds found unusable (a piece gone or damaged when a rank fetched it)."""

    lineage: list[str] = field(default_factory=list)
    bad: set[tuple[str, int, str]] = field(default_factory=set)

    def choose(self, held: list[dict[str, Any]], newer_than: int) -> SnapshotRound | None:
        """The round to restore from: the newest complete one of the lineage, newer than the
        latest checkpoint on storage (report index `newer_than`); None: from storage."""
        ours = [p for p in held if p["attempt_id"] in self.lineage]
        for rnd in complete_rounds(ours):
            if rnd.index > newer_than and (rnd.attempt_id, rnd.index, rnd.kind) not in self.bad:
                return rnd
        return None

    def started(self, attempt_id: str, restored: SnapshotRound | None) -> None:
        """A group started: from `restored`, else from storage (a new lineage)."""
        self.lineage = [*self.lineage, attempt_id] if restored is not None else [attempt_id]

    def unusable(self, where: str) -> bool:
        """A rank found the round at `where` (snapshot://attempt_id/index) unusable; False if
        `where` is not a snapshot round's."""
        if not where.startswith("snapshot://"):
            return False
        attempt_id, index = where[len("snapshot://") :].rsplit("/", 1)
        self.bad |= {(attempt_id, int(index), k) for k in ("snapshot", "jit")}
        return True
