"""The rank's side of the in-memory snapshot tier: take a snapshot, send it to its holders in the
background, save just in time when a peer fails, and restore a round.

`report(..., snapshot=...)`: at every `CheckpointConfig.snapshot_every`-th report, the rank
takes its *piece* of the round, one blob, in one of two ways (`format` describes both):

- `snapshot={"rank0.pt": state, ...}`: a file name -> what `torch.save` takes (a state dict).
  report() copies the tensors into one buffer it keeps for the next snapshot, behind the state's
  structure (`format`: a memcpy, a few ms for tens of MB) and returns; the CRC-32 and the
  sends run in the background, as in CheckFreq and Gemini. No torch.save until a restore
  needs the files. A state with a tensor that format does not take (sparse, quantized, a
  subclass) is saved with torch.save into a zip at once, on the rank's thread.
- `snapshot=save`: report() calls `save(directory)` and packs what it wrote into a zip (stored,
  not compressed), before it returns.

A thread sends the piece to the rank's holders (its own nanny and a peer worker's, `holders`) at
once: a holder on the rank's host links the file the thread wrote the piece into in /dev/shm
(`piece_files`), one on another host takes the bytes over Dask's comms. One piece is in flight
at a time: the next snapshot waits for the previous one to be sent, so once report() returns at
a snapshot round, the rank's piece of the round before is held (or a send failed, which is
logged: snapshots are a tier above the checkpoints on storage, never in place of them). A holder
that failed a send is not sent to again by this rank: it is gone or silent, and each try would
hold the next snapshot up to knobs.SNAPSHOT_SEND_TIMEOUT_S.

`enable_jit_checkpoint(save)`: when this rank fails because a peer went away (its collective
saw the closed connection), it calls `save(directory)` and sends the piece, waited for until a
holder has it, before it leaves; the piece stands for the state at its last report. The rank
that failed first does nothing extra. A restart restores from such a piece when nothing newer
exists.

A restore fetches every rank's piece of the round the driver chose, from the first of its
copies that is still held and whole (its CRC-32s, `format.whole`): from the holder's file where
this host has it, else over Dask's comms. It unpacks them into one local directory (the lowest
rank's file wins where two ranks wrote the same name): what `get_checkpoint()` returns, as from
storage. It starts as the rank does, on the snapshot thread, while the rank joins its group and
builds its model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import knobs
from ..errors import CheckpointDamagedError, SessionError
from ..storage.checkpoint import Checkpoint
from ..worker import scratch
from ..worker.journal import run_key
from . import piece_files
from .piece import Kind, SnapshotPiece, SnapshotRound
from .store import handler

RESTORED = "ft-train-restored"  # under the temporary directory: the rounds restored, by process

if TYPE_CHECKING:
    from ..protocol import RankSpec
    from .format import FlatStager

logger = logging.getLogger("ft_train")

Buffer = bytes | memoryview  # a piece's blob
Saver = Callable[[str], Any]  # save(directory): write this rank's state into it
StateFn = Callable[[], Mapping[str, Any]]  # () -> {file name: state}
Snapshot = Mapping[str, Any] | Saver  # report(snapshot=...): {file name: state}, or a Saver


def _piece(stager: FlatStager, files: Mapping[str, Any]) -> memoryview:
    """`files`' piece: flat, its tensors copied now and its CRC-32 not yet written
    (`format.seal`), or torch.save's zip where a tensor is not plain (rare: on this
    thread)."""
    from .format import NotPlain, pack_state  # torch: not on `import ft_train`

    try:
        return stager.stage(files)
    except NotPlain:
        return pack_state(files)


@dataclass(frozen=True)
class Files:
    """enable_jit_checkpoint(files=...): a function that returns this rank's {file name: state}."""

    files: StateFn


def jit_saver(save: Saver | None, files: StateFn | None) -> Saver | Files:
    """enable_jit_checkpoint's arguments: one of the two, else a SessionError that says so."""
    if save is not None and files is None:
        return save
    if files is not None and save is None:
        return Files(files)
    raise SessionError(
        "enable_jit_checkpoint: give save (a function save(directory)) or files (a function "
        'that returns {file name: state}, e.g. lambda: {"rank0.pt": state()}), one of them'
    )


def check_snapshot(snapshot: Any) -> None:
    """report(snapshot=...) is a mapping of plain file names, or a function save(directory)."""
    if callable(snapshot):
        return
    if not isinstance(snapshot, Mapping):
        raise SessionError(
            f"report(snapshot={type(snapshot).__name__}): give {{file name: state}}, e.g. "
            '{"rank0.pt": {"model": model.state_dict(), "optimizer": opt.state_dict()}}, or a '
            "function save(directory) that writes this rank's state into the directory"
        )
    for name in snapshot:
        if not isinstance(name, str) or not name or os.path.basename(name) != name:
            raise SessionError(
                f"report(snapshot={{{name!r}: ...}}): each key is a plain file name, such as "
                "'rank0.pt' (no directory); the restore gives them in one directory"
            )
        if name in (".", ".."):
            raise SessionError(f"report(snapshot={{{name!r}: ...}}): not a file name")


class RankSnapshots:
    """One rank's snapshots. `holders`: its holders' addresses (none: the tier is off)."""

    def __init__(
        self, run: str, attempt_id: str, rank: int, world: int, holders: Sequence[str], every: int
    ):
        self.run, self.attempt_id, self.rank, self.world = run, attempt_id, rank, world
        self.holders, self.every = list(holders), every
        self.jit_saver: Saver | Files | None = None  # enable_jit_checkpoint's, either form
        self.sent = self.failed = 0
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None  # format.FlatStager: the copies' buffer, kept for the next
        self._restoring: Future[str] | None = None  # the round to restore, being fetched
        self._worker = _this_worker()  # the rank's; the sending thread is not a Dask thread
        if self._worker is None:
            self.holders = []  # not on a Dask worker: no tier

    @classmethod
    def of(cls, spec: RankSpec) -> RankSnapshots:
        run = run_key(spec.storage.uri(spec.name))
        every = spec.snapshot_every or 0
        snapshots = cls(
            run, spec.attempt_id, spec.rank, spec.world_size, spec.snapshot_holders, every
        )
        snapshots.prefetch(spec.snapshot)  # a round to restore: fetched as the rank joins
        return snapshots

    def offer(self, snapshot: Snapshot | None, index: int) -> None:
        """report() `index` with `snapshot=...`: take a snapshot if one is due."""
        if snapshot is None:
            return
        check_snapshot(snapshot)
        if not self.holders or not self.every or index % self.every:
            return
        if callable(snapshot):
            from .format import pack  # torch: not on `import ft_train`

            blob = pack(snapshot)
            self.wait()  # one piece in flight: the previous one is held (or failed) first
            self._submit(self._send, blob, index, "snapshot")
        else:
            self.wait()  # and the buffer the previous piece was copied into is free again
            self._submit(self._seal_and_send, self._stage(snapshot), index)

    def _stage(self, files: Mapping[str, Any]) -> memoryview:
        """The piece of `files`, its tensors copied now (the training goes on changing the
        originals): `_piece`."""
        if self._stager is None:
            import torch

            from .format import FlatStager

            # a holder in this process (Dask's inproc transport) keeps the very buffer sent
            reuse = not any(h.startswith("inproc://") for h in self.holders)
            self._stager = FlatStager(reuse, pin=torch.cuda.is_available())
        try:
            return _piece(self._stager, files)
        except Exception as e:
            raise SessionError(
                f"report(snapshot=...): this state cannot be saved with torch.save: {e!r}"
            ) from e

    def _seal_and_send(self, piece: memoryview, index: int) -> None:
        from .format import seal

        self._send(seal(piece), index, "snapshot")

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._pending = self._thread().submit(fn, *args)

    def _thread(self) -> ThreadPoolExecutor:
        """The snapshot thread: packs and sends each piece, and fetches the round to restore."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ft-train-snapshot")
        return self._executor

    def wait(self, timeout: float | None = None) -> None:
        """Until the piece in flight is sent (or `timeout`: a failing rank gives up on it)."""
        if self._pending is not None:
            try:
                self._pending.result(timeout)
            except TimeoutError:
                return
            except Exception as e:  # a bug, not a holder's failure (`_put` takes those)
                logger.warning("ft-train: rank %d: a snapshot was not sent: %r", self.rank, e)
            self._pending = None

    def jit(self, index: int) -> None:
        """This rank failed because a peer went away: save just in time, if the function opted
        in, and wait (bounded) until a holder has the piece."""
        if self.jit_saver is None or not self.holders:
            return
        from .format import FlatStager, pack, seal

        try:
            if isinstance(self.jit_saver, Files):
                files = self.jit_saver.files()
                check_snapshot(files)
                blob = seal(_piece(FlatStager(reuse=False), files))
            else:
                blob = pack(self.jit_saver)
        except Exception as e:  # the rank fails anyway, with its own error; the save is lost
            logger.warning("ft-train: rank %d: just-in-time save failed: %r", self.rank, e)
            return
        self.wait(knobs.FAIL_FLUSH_S)
        self._send(blob, index, "jit", until_held=True)

    def _send(self, blob: Buffer, index: int, kind: Kind, until_held: bool = False) -> None:
        """The piece to every holder at once; returns once each has answered, or with
        `until_held` once one holds it (the other sends go on). Written into /dev/shm first,
        once, for the holders on this host."""
        path = piece_files.write(blob) if self.holders else None
        piece = SnapshotPiece(self.attempt_id, self.rank, index, kind, self.world, len(blob))
        held: Future[bool] = Future()  # done once a holder holds the piece
        sends = asyncio.run_coroutine_threadsafe(
            self._put_all(piece, blob, path, held),
            self._worker.loop.asyncio_loop,  # tornado's AsyncIOLoop
        )
        if until_held:
            either: list[Future[Any]] = [sends, held]
            wait(either, return_when=FIRST_COMPLETED)
        else:
            sends.result()

    async def _put_all(
        self, piece: SnapshotPiece, blob: Buffer, path: str | None, held: Future[bool]
    ) -> None:
        """`_put` to every holder at once (each bounded by knobs.SNAPSHOT_SEND_TIMEOUT_S),
        then this process's name for the file goes: the holders' own names keep it."""
        try:
            await asyncio.gather(*(self._put(h, piece, blob, path, held) for h in self.holders))
        finally:
            piece_files.unlink(path)

    async def _put(
        self, holder: str, piece: SnapshotPiece, blob: Buffer, path: str | None, held: Future
    ) -> None:
        """One copy of the piece to `holder` (on the worker's event loop): by the file at
        `path` where the holder is on this host, else by its bytes; `held` set once held. The
        piece's record goes in its wire form (Dask's comms carry msgpack)."""
        from distributed.protocol import to_serialize

        put = {"run": self.run, "piece": piece.to_dict()}
        try:
            answer: Any = {"status": piece_files.NOT_HERE}
            if path is not None:
                answer = await _rpc(self._worker, holder, "put", **put, path=path)
            if isinstance(answer, dict) and answer.get("status") == piece_files.NOT_HERE:
                answer = await _rpc(self._worker, holder, "put", **put, blob=to_serialize(blob))
        except Exception as e:  # gone or silent: this copy is not held, nor sent to it again
            answer = f"{e!r}; not sent to again"
            self.holders = [h for h in self.holders if h != holder]
        if isinstance(answer, dict) and answer.get("status") == "OK":
            self.sent += 1
            if not held.done():  # only this event loop sets it
                held.set_result(True)
            return
        self.failed += 1
        logger.warning(
            "ft-train: rank %d: %s %d not held by %s: %s",
            *(self.rank, piece.kind, piece.index, holder, answer),
        )

    def prefetch(self, snapshot: SnapshotRound | None) -> None:
        """Start fetching the round `snapshot` (the driver's choice; None: none) now, on the
        snapshot thread, while the rank joins its group and builds its model."""
        if snapshot is not None and self._restoring is None:
            self._restoring = self._thread().submit(self._restore, snapshot)

    def restored(self, snapshot: SnapshotRound) -> Checkpoint:
        """The round `snapshot` in a local directory, fetched once."""
        self.prefetch(snapshot)
        assert self._restoring is not None
        return Checkpoint.from_directory(self._restoring.result())

    def _restore(self, snapshot: SnapshotRound) -> str:
        copies = snapshot.copies()
        # under a directory of this process's own, so that a killed rank's is swept
        out = tempfile.mkdtemp(dir=scratch.process_dir(scratch.folder(RESTORED)))
        try:
            for rank in sorted(copies, reverse=True):
                self._fetch(snapshot, copies[rank])(out)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out

    def _fetch(self, snapshot: SnapshotRound, copies: list[SnapshotPiece]) -> Saver:
        """One rank's piece, as a function that writes its files into a directory: the first of
        its copies still held and whole (`format.whole`), read from the holder's file where
        this host has it."""
        from .format import whole  # torch: not on `import ft_train`

        why = []
        for piece in copies:
            try:
                blob = self._held_blob(piece)
            except Exception as e:  # gone since the driver chose: the next copy, if any
                why.append(f"{piece.holder}: {e if isinstance(e, LookupError) else repr(e)}")
                continue
            try:
                return whole(blob)
            except ValueError as e:
                why.append(f"{piece.holder}: {e}")
        where = snapshot.where
        raise CheckpointDamagedError(
            f"{where}: no copy of rank {copies[0].rank}'s piece is held whole ({'; '.join(why)})",
            where,
        )

    def _held_blob(self, piece: SnapshotPiece) -> Buffer:
        """A copy's bytes: from the holder's file (`piece_files`) where this host has it, else
        from the holder over Dask's comms."""
        if piece.path and (blob := piece_files.open_held(piece.path)) is not None:
            return blob
        if piece.holder is None:  # a record no holder described: no one to ask
            raise LookupError("not held")
        key = {"attempt_id": piece.attempt_id, "rank": piece.rank, "index": piece.index}
        answer = _call(self._worker, piece.holder, "get", run=self.run, kind=piece.kind, **key)
        status = answer.get("status") if isinstance(answer, dict) else repr(answer)
        if status != "OK":
            raise LookupError(status)
        return answer["blob"]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._stager is not None:
            self._stager.close()
        if self._restoring is not None:
            with contextlib.suppress(Exception):  # what it raised went to get_checkpoint()
                # fetches are bounded (knobs.SNAPSHOT_SEND_TIMEOUT_S)
                shutil.rmtree(self._restoring.result(), ignore_errors=True)


def _this_worker() -> Any:
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:  # a rank run outside Dask (a unit test's)
        return None


async def _rpc(worker: Any, address: str, op: str, **kwargs: Any) -> Any:
    """`op` on a holder, over the rank's worker's Dask connection pool, on its event loop."""
    call = getattr(worker.rpc(address), handler(op))
    return await asyncio.wait_for(call(**kwargs), knobs.SNAPSHOT_SEND_TIMEOUT_S)


def _call(worker: Any, address: str, op: str, **kwargs: Any) -> Any:
    """`_rpc` from any other thread."""
    loop = worker.loop.asyncio_loop  # tornado's AsyncIOLoop
    return asyncio.run_coroutine_threadsafe(_rpc(worker, address, op, **kwargs), loop).result()
