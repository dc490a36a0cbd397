"""What one snapshot piece is, and one round of them, as the tier's modules pass them.

A *piece* is one rank's share of one round: its bytes (`format`) and this record of them. A
record names one copy: the same piece sent to two holders is two records, each with its
holder's address and, where the holder keeps it as a file in the host's shared memory
(`piece_files`), that file's path. A *round* is one attempt's pieces at one report index and of
one kind, never pieces of two attempts (`rounds` says which round a restart takes).

A record has no checksum: the bytes carry their own CRC-32s (`format`), which the restoring
rank checks; the holders keep the bytes as they arrived.

Inside ft-train a piece is a `SnapshotPiece` and a round a `SnapshotRound`. A piece's dict form
(`to_dict`/`from_dict`) is for where it crosses Dask's comms, which carry msgpack, not Python
objects: a rank's `put` to a holder (`rank` -> `store`) and a holder's answer to `describe`
(`store` -> `holders`). A round goes to the ranks of the next group inside their `RankSpec`,
pickled as it is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

# "snapshot": every rank's, every CheckpointConfig.snapshot_every reports;
# "jit": a survivor's, saved just in time when a peer failed (`enable_jit_checkpoint`)
Kind = Literal["snapshot", "jit"]
KINDS: tuple[Kind, ...] = ("snapshot", "jit")

WHERE = "snapshot://"  # a round's name in errors: snapshot://<attempt id>/<report index>


@dataclass(frozen=True)
class SnapshotPiece:
    """One copy of one rank's piece of a round."""

    attempt_id: str  # the attempt whose rank took it
    rank: int
    index: int  # the report index it stands for
    kind: Kind
    world_size: int  # of its attempt: a snapshot round is complete with this many ranks' pieces
    size: int  # its bytes, as the rank sent them
    holder: str | None = None  # the holder's address; None until a holder describes it
    path: str | None = None  # the holder's file in this host's shared memory, if it has one

    @property
    def round_key(self) -> tuple[str, int, Kind]:
        """The round it belongs to: (attempt id, report index, kind)."""
        return (self.attempt_id, self.index, self.kind)

    def held_by(self, holder: str, path: str | None) -> SnapshotPiece:
        """This piece as `holder` holds it (in the file at `path`, if in one)."""
        return replace(self, holder=holder, path=path)

    def to_dict(self) -> dict[str, Any]:
        """The wire form, for Dask's comms."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SnapshotPiece:
        """From the wire form; a ValueError naming what is wrong where it is not one (an older
        or foreign handler's answer)."""
        names = {f.name for f in fields(cls)}
        missing = names - {"holder", "path"} - d.keys()
        if missing:
            raise ValueError(f"not a snapshot piece: {sorted(missing)} missing from {d!r}")
        if d["kind"] not in KINDS:
            raise ValueError(f"not a snapshot piece: kind {d['kind']!r} is not one of {KINDS}")
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class SnapshotRound:
    """The round a restart restores from: every copy held of each rank's piece (`pieces`, by
    rank), what each rank of the next group is started with (`RankSpec.snapshot`)."""

    attempt_id: str
    index: int
    kind: Kind
    pieces: tuple[SnapshotPiece, ...]

    @property
    def name(self) -> str:
        """As a user reads it (the run state's `restored_snapshot`, the log)."""
        return f"{self.kind} {self.index} of attempt {self.attempt_id[:8]}"

    @property
    def where(self) -> str:
        """As an error names it (`CheckpointDamagedError.where`): `parse_where` reads it back."""
        return f"{WHERE}{self.attempt_id}/{self.index}"

    def copies(self) -> dict[int, list[SnapshotPiece]]:
        """rank -> the copies of its piece, in the order held."""
        out: dict[int, list[SnapshotPiece]] = {}
        for piece in self.pieces:
            out.setdefault(piece.rank, []).append(piece)
        return out


def parse_where(where: str) -> tuple[str, int] | None:
    """(attempt id, report index) of a round's `where`; None where it names no round (a
    checkpoint on storage)."""
    if not where.startswith(WHERE):
        return None
    attempt_id, index = where[len(WHERE) :].rsplit("/", 1)
    return attempt_id, int(index)
