"""Which in-memory snapshot round a restart restores from, if any: the controller's view of
the tier.

The holders say what they hold (`Cluster.held_snapshots`). A rank's piece may have two copies,
on two holders (`holders`). A round is one attempt's pieces at one report index and of one
kind, never pieces of two attempts (`piece`). A snapshot round is complete when every rank of its
attempt has a copy of its piece held; a just-in-time round (saved by the survivors of a
failure) when at least one survivor's piece is. The restart takes the newest complete round
newer than the latest checkpoint on storage (a snapshot round before a just-in-time one at the
same index), else storage. The restoring ranks check each copy's CRC-32 as they fetch it
(`format`): a round with a piece of which no copy is held whole is found unusable then
(`SnapshotTier.unusable`), and the next restart passes it over.

Only the attempts of this driver's current lineage count: the attempt that ran last, and those
before it back to the one that restored from storage. A round of an attempt that a restart from
storage abandoned belongs to another history, even where its holders still answer; and a new
driver starts from storage, as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .piece import KINDS, SnapshotPiece, SnapshotRound, parse_where


def complete_rounds(held: list[SnapshotPiece]) -> list[SnapshotRound]:
    """Every complete round in `held` (the holders' answers, a copy each), newest first."""
    by_round: dict[tuple, dict[int, list[SnapshotPiece]]] = {}
    for p in held:
        by_round.setdefault(p.round_key, {}).setdefault(p.rank, []).append(p)
    rounds = []
    for (attempt_id, index, kind), copies in by_round.items():
        world = max(p.world_size for ps in copies.values() for p in ps)
        if set(copies) == set(range(world)) or kind == "jit":
            ordered = tuple(p for r in sorted(copies) for p in copies[r])
            rounds.append(SnapshotRound(attempt_id, index, kind, ordered))
    return sorted(rounds, key=lambda r: (r.index, r.kind == "snapshot"), reverse=True)


@dataclass
class SnapshotTier:
    """The controller's view: the lineage of attempts whose rounds a restart may take, and the
    rounds found unusable (a piece gone or damaged when a rank fetched it)."""

    lineage: list[str] = field(default_factory=list)
    bad: set[tuple[str, int, str]] = field(default_factory=set)

    def choose(self, held: list[SnapshotPiece], newer_than: int) -> SnapshotRound | None:
        """The round to restore from: the newest complete one of the lineage, newer than the
        latest checkpoint on storage (report index `newer_than`); None: from storage."""
        ours = [p for p in held if p.attempt_id in self.lineage]
        for rnd in complete_rounds(ours):
            if rnd.index > newer_than and (rnd.attempt_id, rnd.index, rnd.kind) not in self.bad:
                return rnd
        return None

    def started(self, attempt_id: str, restored: SnapshotRound | None) -> None:
        """A group started: from `restored`, else from storage (a new lineage)."""
        self.lineage = [*self.lineage, attempt_id] if restored is not None else [attempt_id]

    def unusable(self, where: str) -> bool:
        """A rank found the round at `where` (`SnapshotRound.where`) unusable; False if `where`
        is not a snapshot round's."""
        if (found := parse_where(where)) is None:
            return False
        attempt_id, index = found
        self.bad |= {(attempt_id, index, k) for k in KINDS}
        return True
