"""Asynchronous checkpoint uploads: `report(..., checkpoint_upload_mode="async")`. Worker side.

`report()` hands the checkpoint's directory to the rank's `Uploads` and returns. The files are
first snapshotted into a staging directory on the same filesystem (`{tmp}/ft-train-staging/`,
or `.ft-train-staging/` beside the checkpoint's directory when that is on another filesystem):
hard links, a few microseconds a file, or copies where a link is impossible. One background
thread then uploads the snapshots, oldest first, and only once every file of one is stored sends
that report's message (with the files' sizes and sha256) to the driver. The driver commits a
round only when every rank's message has arrived, and writes the manifest last: a checkpoint
whose upload did not finish is never committed, and nothing on the driver's side differs from a
synchronous upload.

Contract:
- at most `knobs.MAX_IN_FLIGHT_UPLOADS` uploads are pending (queued or uploading); `submit` blocks beyond that;
- after `submit` returns, the caller MAY delete or rename its directory and its files, but MUST
  NOT rewrite a file in place until the upload is done: a hard link shares the file's contents,
  and `torch.save` onto an existing path truncates and rewrites that same file. A file found
  changed after its upload fails that upload, rather than commit a torn checkpoint;
- an upload error is latched: `check()` (the rank's next report()) and `flush()` (its finish)
  raise it as a `StorageError`, an ordinary rank failure that the run retries;
- a snapshot's staging directory is removed once its upload succeeded, failed or was dropped.
  A killed process cannot do that: each process holds an flock on its own staging directory,
  and the next `Uploads` to use the same staging root removes those whose lock is free
  (`scratch.claim_dir`).

The uploaded files of a failed or killed upload stay in storage as an uncommitted directory,
which the driver's `collect_orphans` removes.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from .. import knobs
from ..errors import SessionError, StorageError
from ..protocol import Report
from ..storage.fs import Storage, UploadStopped, local_files
from . import scratch

STAGING = "ft-train-staging"

# A failed link means "copy instead" for these; anything else is a real error.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES}


@dataclass
class _Job:
    staged: str  # the snapshot, removed after the upload
    remote: str  # storage path of the checkpoint directory
    msg: Report  # the report's message, sent once the files are stored
    linked: dict[str, tuple[int, int]]  # hard-linked files: (size, mtime_ns) when snapshotted


class Uploads:
    """The background uploads of one rank's session."""

    def __init__(
        self,
        storage: Storage,
        send: Callable[[Report], None],
        max_in_flight: int = knobs.MAX_IN_FLIGHT_UPLOADS,
        staging_root: str | None = None,
    ):
        self.storage, self.send, self.max_in_flight = storage, send, max_in_flight
        self._tmp_root = staging_root or scratch.folder(STAGING)
        self._own: dict[str, tuple[str, int]] = {}  # staging root -> (our directory, lock fd)
        self._jobs: collections.deque[_Job] = collections.deque()  # [0] is uploading
        self._cond = threading.Condition()
        self._error: StorageError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the rank's side ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the error of an earlier upload, if one failed."""
        if self._error is not None:
            raise self._error

    def submit(self, local_dir: str, remote: str, msg: Report) -> None:
        """Snapshot `local_dir` and queue its upload to `remote`; `msg` is sent once it is done."""
        self.check()
        with self._cond:  # the bound first: the snapshot is taken only when it may be queued
            self._cond.wait_for(lambda: len(self._jobs) < self.max_in_flight or self._error)
        self.check()
        staged, linked = self._snapshot(local_dir, msg.index)
        with self._cond:
            self._jobs.append(_Job(staged, remote, msg, linked))
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ft-train-uploads", daemon=True)
            self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every upload is done (False if `timeout` passed first); raise an error."""
        with self._cond:
            done = self._cond.wait_for(lambda: not self._jobs, timeout)
        self.check()
        return done

    def close(self, timeout: float = 5.0) -> None:
        """Drop the uploads still pending (the current one stops at its next chunk), wait up to
        `timeout` for the thread, and remove this session's staging directories. Idempotent."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._cleanup()
        # else the thread is stuck in a storage call: it cleans up once that returns (and if it
        # never does, this process's lock goes with the process, and a later Uploads sweeps)

    def _cleanup(self) -> None:
        """Remove the snapshots not uploaded and this session's staging directories."""
        with self._cond:
            jobs, self._jobs = list(self._jobs), collections.deque()
            own, self._own = self._own, {}
        for job in jobs:
            shutil.rmtree(job.staged, ignore_errors=True)
        for path, fd in own.values():
            scratch.release(path, fd)

    # -- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._stop.is_set())
                if self._stop.is_set():
                    break
                job = self._jobs[0]
            try:
                self._upload(job)
            except UploadStopped:
                pass  # close() asked for it: the group is going away, nothing to report
            except BaseException as e:  # latched, raised by the rank's next report() or finish()
                self._fail(job, e)
            finally:
                shutil.rmtree(job.staged, ignore_errors=True)
                with self._cond:
                    if self._jobs and self._jobs[0] is job:
                        self._jobs.popleft()
                    self._cond.notify_all()
        self._cleanup()  # close() may have stopped waiting for this thread

    def _upload(self, job: _Job) -> None:
        files = self.storage.upload_dir(
            job.staged, job.remote, should_stop=self._stop.is_set, rank=job.msg.rank
        )
        for rel, (size, mtime_ns) in job.linked.items():
            st = os.stat(os.path.join(job.staged, rel))
            if (st.st_size, st.st_mtime_ns) != (size, mtime_ns) or files[rel]["size"] != size:
                raise StorageError(
                    f"{rel} was written to after report() returned, while its asynchronous "
                    "upload was pending: with checkpoint_upload_mode='async' the checkpoint's "
                    "files must not be rewritten in place until the upload is done; save each "
                    "checkpoint into a new directory (or delete a file before writing it again)"
                )
        if self._stop.is_set():
            return  # stored, but the group is going away: the driver would ignore the message
        self.send(replace(job.msg, files=files))

    def _fail(self, job: _Job, e: BaseException) -> None:
        index = job.msg.index
        error = (
            e
            if isinstance(e, StorageError)
            else StorageError(
                f"the asynchronous upload of report {index}'s checkpoint to "
                f"{self.storage.uri(job.remote)} failed: {type(e).__name__}: {e}"
            )
        )
        if error is not e:
            error.__cause__ = e
        with self._cond:
            self._error = error
            # The later snapshots will never be committed (this rank fails at its next report):
            # drop them now rather than upload them.
            while len(self._jobs) > 1:
                shutil.rmtree(self._jobs.pop().staged, ignore_errors=True)

    # -- snapshots ------------------------------------------------------------------------------

    def _snapshot(self, src: str, index: int) -> tuple[str, dict[str, tuple[int, int]]]:
        """Hard-link every file of `src` into a new staging directory (copy where a link is
        impossible); return it and the (size, mtime_ns) of the linked files."""
        rels = local_files(src)
        dev = os.stat(src).st_dev
        root = self._tmp_root
        if rels and _device(os.path.dirname(root)) != dev:
            beside = os.path.join(os.path.dirname(src), "." + STAGING)  # the same filesystem
            if os.access(os.path.dirname(src), os.W_OK):
                root = beside
        staged = os.path.join(self._own_dir(root), f"{index:06d}-{uuid.uuid4().hex[:6]}")
        linked: dict[str, tuple[int, int]] = {}
        try:
            for rel in rels:
                s, d = os.path.join(src, rel), os.path.join(staged, rel)
                os.makedirs(os.path.dirname(d), exist_ok=True)
                try:
                    os.link(s, d)
                except OSError as e:
                    if e.errno not in _NO_LINK:
                        raise
                    shutil.copyfile(s, d)  # another filesystem: a private copy
                    continue
                st = os.stat(d)
                linked[rel] = (st.st_size, st.st_mtime_ns)
            os.makedirs(staged, exist_ok=True)  # an empty checkpoint is a valid one
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return staged, linked

    def _own_dir(self, root: str) -> str:
        """This session's directory under `root`, locked for its lifetime."""
        if root not in self._own:
            own = scratch.claim_dir(root)
            with self._cond:
                self._own[root] = own
        return self._own[root][0]


# -- staging_dir: where a rank writes a checkpoint before report() -----------------------------


@contextlib.contextmanager
def staging_dir(size_bytes: int | None = None) -> Iterator[str]:
    """A new empty directory to write a checkpoint's files into before report(); removed when
    the block ends (a killed process's is removed by the next process that uses one).

    Given `size_bytes`, about what will be written, the directory is in memory (/dev/shm) when
    that times (knobs.MAX_IN_FLIGHT_UPLOADS + 1) fits in half of the memory free there: writing the files then
    costs what serialising in memory does, and never waits for a disk that is still busy with
    the previous checkpoints. Otherwise, and without `size_bytes`, it is under the temporary
    directory. With checkpoint_upload_mode="async", report() snapshots the files with hard
    links on the same filesystem, so the block may end right after report()."""
    if size_bytes is not None and (not isinstance(size_bytes, int) or size_bytes < 0):
        raise SessionError(
            f"staging_dir(size_bytes={size_bytes!r}): give the checkpoint's size in bytes (an "
            "int >= 0), or None for a directory on disk"
        )
    in_memory = (
        size_bytes is not None
        and size_bytes * (knobs.MAX_IN_FLIGHT_UPLOADS + 1) <= scratch.memory_free() // 2
    )
    root = scratch.folder(STAGING, memory=in_memory)
    path = tempfile.mkdtemp(prefix="checkpoint-", dir=scratch.process_dir(root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None
