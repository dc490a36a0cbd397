"""Snapshot pieces in shared memory, for the holders on the rank's own host.

A rank writes its piece once into a file in `/dev/shm` (`write`), and a holder on the same host
takes it by a hard link of its own and a read-only map of the file (`link`): one copy in memory
for the rank's two holders on its host, and no bytes through a socket. A holder on another host
cannot link the file (the path is not there, or is another host's) and takes the bytes over
Dask's comms instead, as `store` says. A restoring rank reads a copy held in a file
from its path where it can open it (`open_held`).

The file outlives every process that has a name for it until the last name is removed, so a
rank's SIGKILL (or its holder's) loses no piece; its data is gone with the host's memory, as a
holder's own memory would be. Same-host copies share that memory: a bit flip in it damages
both, and a restore then falls back to an older round or to storage, as for any damaged piece.

Names are `<pid namespace>-<pid>-<random>`, each of the process that created it. A process
killed before it removed its names leaves them behind; `sweep` removes the names of dead
processes of this pid namespace (a holder sweeps when it starts and when a run ends).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from typing import Any

from ..worker import scratch

NOT_HERE = "not on this host"  # a holder's answer to a path it cannot link: send the bytes


def directory() -> str | None:
    """The host's shared directory for pieces, or None where the host has no shared memory to
    write (`scratch.shared_memory`)."""
    if scratch.shared_memory() is None:
        return None
    d = scratch.folder("ft-train-snapshots", memory=True)
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return None
    return d if os.access(d, os.W_OK) else None


def _namespace() -> str:
    try:  # "pid:[4026531836]"
        return os.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]")
    except (OSError, IndexError):
        return "0"


def _new_name(d: str) -> str:
    return os.path.join(d, f"{_namespace()}-{os.getpid()}-{uuid.uuid4().hex}")


def write(blob: Any) -> str | None:
    """`blob` in a new file of the shared directory; None where there is none, or no room."""
    d = directory()
    if d is None:
        return None
    path = _new_name(d)
    try:
        with open(path, "xb") as f:
            f.write(blob)
    except OSError:  # /dev/shm full (a container's is 64 MB by default): the bytes go by socket
        unlink(path)
        return None
    return path


def link(path: str) -> tuple[str, memoryview] | None:
    """A name of this process's own for the file at `path`, and a read-only map of it; None
    where the file is not in this host's shared directory (a rank on another host)."""
    if not _here(path):
        return None
    mine = _new_name(os.path.dirname(path))
    try:
        os.link(path, mine)
        return mine, open_map(mine)
    except OSError:
        unlink(mine)
        return None


def open_held(path: str) -> memoryview | None:
    """A holder's file, mapped read-only, where this host has it; None where it does not (another
    host's, or dropped since)."""
    if not _here(path):
        return None
    try:
        return open_map(path)
    except OSError:
        return None


def _here(path: str) -> bool:
    """Whether `path` names a file of this host's shared directory (if it exists)."""
    d = directory()
    return d is not None and os.path.dirname(path) == d


def open_map(path: str) -> memoryview:
    """The file at `path`, mapped read-only (OSError where it cannot be opened)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))


def unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):  # removed already
            os.unlink(path)


def sweep() -> int:
    """Remove the names left by dead processes of this pid namespace; how many were removed."""
    d = directory()
    if d is None:
        return 0
    ns, removed = _namespace(), 0
    for name in os.listdir(d):
        owner_ns, _, rest = name.partition("-")
        pid = rest.partition("-")[0]
        if owner_ns != ns or not pid.isdigit() or _alive(int(pid)):
            continue
        unlink(os.path.join(d, name))
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
