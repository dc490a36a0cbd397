"""The node's scratch space: where ft-train writes on a worker's host outside storage, and the
one place that names /dev/shm.

Two roots. The host's shared memory (`SHARED_MEMORY`, /dev/shm, a tmpfs), where it exists and
this process may write it: a write costs no disk, and a file outlives the process that wrote it
until it is removed (a killed rank's journal and snapshot pieces are still there for its
nanny). And the temporary directory (`tempfile.gettempdir()`, a test's own where it sets one).
Each user has a folder of its own under one of them (`folder`):

    folder              root                                     its owner
    ft-train-journal    shared memory, else tmp                  worker.journal
    ft-train-snapshots  shared memory only (else none)           snapshots.piece_files
    ft-train-packing    shared memory, else tmp                  snapshots.format
    ft-train-restored   tmp                                      snapshots.rank
    ft-train-staging    shared memory where a checkpoint fits    worker.uploads
                        (`memory_free`), else tmp
    ft-train-cache      tmp                                      worker.download_cache

Per-process directories: a process that writes there and may be killed (SIGKILL, the OOM
killer) before it cleans up works in a directory of its own, `claim_dir`: the directory's lock
file is flocked by its owner while the owner lives, and the next process that claims a
directory under the same folder removes those whose lock is free. `process_dir` is the one
directory a process keeps under a folder for its lifetime; `release` gives a claimed one back.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
import uuid

SHARED_MEMORY = "/dev/shm"

_process_dirs: dict[str, str] = {}  # folder -> this process's directory (locked until exit)
_process_dirs_lock = threading.Lock()


def shared_memory() -> str | None:
    """The host's shared memory where it has one this process may write, else None."""
    ok = os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK)
    return SHARED_MEMORY if ok else None


def folder(name: str, memory: bool = False) -> str:
    """The scratch folder `name`: in shared memory where `memory` and the host has it, else
    under the temporary directory. Not created here (`claim_dir` and the users create it)."""
    root = shared_memory() if memory else None
    return os.path.join(root or tempfile.gettempdir(), name)


def memory_free() -> int:
    """The bytes that shared memory has room for now: the tmpfs's free space, bounded by the
    memory available (a tmpfs's size may exceed the memory that is free); 0 without one."""
    if (root := shared_memory()) is None:
        return 0
    try:
        st = os.statvfs(root)
    except OSError:
        return 0
    return min(st.f_bavail * st.f_frsize, _memory_available())


def _memory_available() -> int:
    """MemAvailable from /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux: no room is claimed, the caller writes to the temporary directory
        pass
    return 0


def claim_dir(root: str) -> tuple[str, int]:
    """A new directory under `root` and the fd of its flock: the directory is its owner's while
    the fd is open (a killed process's lock is free). Removes first the directories under
    `root` whose owner is gone."""
    os.makedirs(root, exist_ok=True)
    _sweep(root)
    while True:
        own = os.path.join(root, uuid.uuid4().hex)
        # Crash ordering: the lock is held before the directory exists, so a sweeper that finds
        # a directory and gets its lock knows that its owner is gone.
        fd = os.open(own + ".lock", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, own + ".lock"):
            break
        os.close(fd)  # a sweeper took the lock between its creation and our flock
    os.makedirs(own)
    return own, fd


def release(path: str, fd: int) -> None:
    """Give back a directory of `claim_dir`: removed with what is in it, then its lock."""
    shutil.rmtree(path, ignore_errors=True)
    _unlink(path + ".lock")
    os.close(fd)


def process_dir(root: str) -> str:
    """This process's directory under `root` (`claim_dir`), the same for its lifetime: what a
    killed process left in its own is removed by the next process that claims one there."""
    with _process_dirs_lock:
        if root not in _process_dirs:
            try:  # the lock's fd stays open with the process
                _process_dirs[root] = claim_dir(root)[0]
            except OSError:  # the root is another user's: a directory of our own, unswept
                _process_dirs[root] = tempfile.mkdtemp(
                    prefix=os.path.basename(root) + "-", dir=os.path.dirname(root)
                )
        return _process_dirs[root]


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # a sweeper removed it already


def _sweep(root: str) -> None:
    """Remove the directories (and stray locks) under `root` of processes that died."""
    for name in os.listdir(root):
        base = name[: -len(".lock")] if name.endswith(".lock") else name
        lock = os.path.join(root, base + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            if not name.endswith(".lock"):  # an owner creates its lock first: this one is gone
                shutil.rmtree(os.path.join(root, base), ignore_errors=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # its owner is alive
            continue
        try:
            shutil.rmtree(os.path.join(root, base), ignore_errors=True)
            _unlink(lock)
        finally:
            os.close(fd)
