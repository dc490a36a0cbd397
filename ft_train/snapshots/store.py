"""The holder's side of the in-memory snapshot tier: the pieces ranks sent, in memory.

A rank's snapshot piece (one blob, `format`) is held by two *nannies* where the cluster has
them: its own worker's and a peer worker's (`holders`).
A nanny is a different process from the rank, which outlives its worker as the journals' reader
does, so a rank's death (SIGKILL, the OOM killer, the driver killing its worker) loses no copy,
and the loss of the rank's node loses one copy of two. A worker without a nanny holds pieces
itself. A holder on the rank's host takes the piece by a link to the file the rank wrote in
/dev/shm (`piece_files`), one on another host by its bytes. The `SnapshotHolder` plugins add
four handlers to the holder's Dask server, reached over Dask's own comms (`Server.rpc`):

    ft_train_snapshot_put       store one piece
    ft_train_snapshot_describe  what is held for a run
    ft_train_snapshot_get       one piece's bytes
    ft_train_snapshot_drop      forget a run

A piece's record crosses them in its wire form (`SnapshotPiece.to_dict`): `put` takes it and
`describe` answers with it; inside the store it is a `SnapshotPiece`.

Bounded: a holder keeps at most `knobs.SNAPSHOTS_PER_RANK` pieces per (run, rank), the oldest
received dropped first, whatever attempt sent them (a round is identified by its attempt id and
report index, so pieces of two attempts are never taken for one round: `rounds`).
A nanny holds its own rank's pieces and a peer rank's: twice one rank's.

A holder keeps a piece as it arrived (no copy) and does not check it: the rank that restores it
does, before it uses it (its CRC-32s, `format`), and takes another copy, or fails over to an
older round or to storage, when it is damaged (`rank`). Checking at every put and every
describe as well cost the holders CPU at every snapshot, on the ranks' cores, and the restart its
time (bench/README.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin
from distributed.protocol import to_serialize

from .. import knobs
from . import piece_files
from .piece import SnapshotPiece

logger = logging.getLogger("ft_train")

HANDLERS = ("put", "describe", "get", "drop")


def handler(op: str) -> str:
    """The name of the holder's handler for `op` (one of HANDLERS), as a rank and the driver
    call it over Dask's comms."""
    return f"ft_train_snapshot_{op}"


# holder address -> its store: the holders in this process (a local cluster's nannies run in
# the driver's process), for a test or a measurement that looks at what they hold.
STORES: dict[str, SnapshotStore] = {}


@dataclass
class HeldPiece:
    """A piece as this holder keeps it: its record, its bytes, and its file if it has one."""

    piece: SnapshotPiece
    blob: memoryview
    path: str | None = None  # this holder's name for the piece's file in /dev/shm, if in one

    def forget(self) -> None:
        piece_files.unlink(self.path)  # the memory goes with the last name and map


class SnapshotStore:
    """One holder's pieces; its handlers run on the holder's event loop (the lock: a test
    reads it from another thread)."""

    def __init__(self, address: str):
        self.address = address
        self.pieces: dict[tuple[str, int], deque[HeldPiece]] = {}  # (run, rank) -> oldest first
        self.peak_bytes = 0  # the most held at once, since this store began
        self._lock = threading.Lock()

    def put(
        self, run: str, piece: dict[str, Any], blob: Any = None, path: str | None = None
    ) -> dict[str, Any]:
        """Hold a piece (`piece`: its wire form, `SnapshotPiece.to_dict`): its bytes (`blob`),
        or the file the rank wrote (`path`) where this holder is on the rank's host, else
        NOT_HERE (the rank then sends the bytes)."""
        record = SnapshotPiece.from_dict(piece)
        if path is not None:
            if (linked := piece_files.link(path)) is None:
                return {"status": piece_files.NOT_HERE}
            path, blob = linked
        held = HeldPiece(record, memoryview(blob), path)
        with self._lock:
            slot = self.pieces.setdefault((run, record.rank), deque())
            slot.append(held)
            while len(slot) > knobs.SNAPSHOTS_PER_RANK:
                slot.popleft().forget()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())
        return {"status": "OK"}

    def describe(self, run: str) -> list[dict[str, Any]]:
        """What this holder holds for `run`, a piece each, in their wire form: a rank on this
        host reads a piece from its `path`."""
        with self._lock:
            held = [h for (r, _), slot in self.pieces.items() if r == run for h in slot]
        return [h.piece.held_by(self.address, h.path).to_dict() for h in held]

    def get(self, run: str, attempt_id: str, rank: int, index: int, kind: str) -> Any:
        with self._lock:
            for h in self.pieces.get((run, rank), ()):
                if h.piece.round_key == (attempt_id, index, kind):
                    return {"status": "OK", "blob": to_serialize(h.blob)}
        return {"status": "missing"}

    def drop(self, run: str) -> int:
        with self._lock:
            gone = [k for k in self.pieces if k[0] == run]
            for k in gone:
                for p in self.pieces.pop(k):
                    p.forget()
        piece_files.sweep()  # what killed ranks and holders left in /dev/shm
        return len(gone)

    def close(self) -> None:
        with self._lock:
            for slot in self.pieces.values():
                for p in slot:
                    p.forget()
            self.pieces.clear()

    def held_bytes(self, run: str | None = None) -> int:
        return sum(
            h.blob.nbytes
            for (r, _), slot in list(self.pieces.items())
            if run is None or r == run
            for h in slot
        )

    def held_pieces(self, run: str) -> dict[int, list[int]]:
        """rank -> the report indexes held for it (a measurement's view)."""
        with self._lock:
            return {k[1]: [h.piece.index for h in s] for k, s in self.pieces.items() if k[0] == run}


def _install(server) -> None:
    piece_files.sweep()
    store = SnapshotStore(server.address)
    server.handlers.update({handler(op): getattr(store, op) for op in HANDLERS})
    STORES[server.address] = store


def _uninstall(server) -> None:
    for op in HANDLERS:
        server.handlers.pop(handler(op), None)
    if (store := STORES.pop(server.address, None)) is not None:
        store.close()


class SnapshotHolder(NannyPlugin):
    """On every nanny (and those that join later): holds the pieces sent to it."""

    name = "ft-train-snapshot-holder"
    idempotent = True  # a later run on the same cluster keeps what the nannies hold

    def setup(self, nanny) -> None:
        _install(nanny)

    def teardown(self, nanny) -> None:
        _uninstall(nanny)


class SnapshotWorkerHolder(WorkerPlugin):
    """On a worker without a nanny (`dask worker --no-nanny`): it holds the pieces itself."""

    name = "ft-train-snapshot-worker-holder"
    idempotent = True

    def setup(self, worker) -> None:
        if worker.nanny is None:
            _install(worker)

    def teardown(self, worker) -> None:
        if worker.nanny is None:
            _uninstall(worker)
