"""The per-node cache of downloaded checkpoints, `{tmp}/ft-train-cache/`, and its eviction.
Worker side: `Checkpoint.as_directory()` of a remote checkpoint goes through `cached`.

One entry per checkpoint URL, under a key hashed from it:
  `{key}/`           the checkpoint's verified files, renamed into place complete
  `{key}.partial-*`  a download in progress, or one whose rank was killed
  `{key}.lock`       its flock: shared while a rank uses the entry (inside `as_directory`,
                     downloading included), exclusive while an eviction removes it
  `{key}.download`   a flock held by the one rank of the node that downloads it

Eviction, so that disk use stays flat over any number of restores: after each download, every
entry past the `knobs.DOWNLOAD_CACHE_KEEP` most recently used (a use touches `{key}/`) is removed, each only if its
lock can be taken exclusively at once. An entry a rank has open, or one being downloaded, is
never removed; a killed rank's lock goes with its process, so its partial download and its open
entry go at the next eviction. The cache holds at most `knobs.DOWNLOAD_CACHE_KEEP` entries plus those in use.

Two ranks of a node restoring one checkpoint at once: both take the shared lock and find no
directory; the first to take the download lock downloads, the other waits on it and then finds
the directory complete. Only one downloads, and neither waits for the other to leave its block.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator

from .. import knobs

CACHE = "ft-train-cache"


def key_of(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:20]


@contextlib.contextmanager
def cached(root: str, url: str, fetch: Callable[[str], None]) -> Iterator[str]:
    """A directory under `root` with the checkpoint at `url`, filled by `fetch(directory)` on
    first use (which MUST leave only verified files); it stays while the block runs."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, key_of(url))
    fd = _hold(final + ".lock", fcntl.LOCK_SH)  # until the block ends: no eviction removes it
    try:
        if not os.path.isdir(final):
            _download(final, fetch)
            evict(root, keep=knobs.DOWNLOAD_CACHE_KEEP, current=final)
        os.utime(final)  # most recently used
        yield final
    finally:
        os.close(fd)


def _download(final: str, fetch: Callable[[str], None]) -> None:
    """Fill `final` unless another rank of the node has meanwhile. The caller holds the entry's
    shared lock, so no eviction can remove the download lock or the directory under us.

    The download has its own lock, not the entry's exclusive one: a rank waiting to download
    must not wait for the ranks already reading the entry to leave their block (they may be
    waiting for it in a collective: a deadlock)."""
    with open(final + ".download", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per node; the others wait for it
        if os.path.isdir(final):
            return
        _remove_partials(final)  # a killed rank's: none is in progress under our lock
        partial = f"{final}.partial-{uuid.uuid4().hex[:8]}"
        try:
            fetch(partial)
            os.replace(partial, final)  # a reader sees all files or no directory
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def evict(root: str, keep: int, current: str = "") -> list[str]:
    """Remove the entries under `root` past the `keep` most recently used (`current` counts as
    one of them and stays), skipping those in use; return the keys removed."""
    keys: dict[str, float] = {}
    for name in os.listdir(root):
        key = name.split(".", 1)[0]
        try:  # a leftover with no complete directory (a partial, a lock) ranks oldest
            keys[key] = max(keys.get(key, -1.0), os.stat(os.path.join(root, key)).st_mtime)
        except FileNotFoundError:
            keys.setdefault(key, -1.0)
    kept = {os.path.basename(current)} if current else set()
    ranked = sorted((k for k in keys if k not in kept), key=keys.__getitem__, reverse=True)
    return [k for k in ranked[max(0, keep - len(kept)) :] if _remove(os.path.join(root, k))]


def _remove(final: str) -> bool:
    """Remove an entry if nobody holds its lock; say whether it was."""
    lock = final + ".lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:  # another user's cache entry: not ours to remove
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a rank reads it or downloads it
        if not _same_file(fd, lock):
            return False  # removed by another eviction meanwhile
        shutil.rmtree(final, ignore_errors=True)
        _remove_partials(final)
        _unlink(final + ".download")
        # Crash ordering: the lock file goes last, while held. A rank that opened it before
        # finds it unlinked once it gets the lock (`_same_file`) and opens the new one.
        os.unlink(lock)
        return True
    finally:
        os.close(fd)


def _hold(path: str, mode: int) -> int:
    """An fd of the lock file at `path`, locked with `mode` (waits)."""
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # an eviction unlinked it after we opened it: take the new one


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # never created: the entry was never downloaded here


def _remove_partials(final: str) -> None:
    root, key = os.path.split(final)
    for name in os.listdir(root):
        if name.startswith(key + ".partial-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
