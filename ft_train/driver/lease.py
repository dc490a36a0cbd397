"""One driver per run: a lease on the run's storage, `{storage_path}/{name}/driver_lease.json`.

A driver takes the lease before it reads the run state and holds it until it ends. A second
driver for the same run (a scheduled run that fires while the previous one still trains, a
rerun started by hand) then refuses to start with `RunLockedError`, naming the holder, instead
of taking the first one's run for a crashed one and writing the run state beside it.

Taking and renewing the lease are compare-and-swap writes (`Storage.write_if`: a conditional
PUT on S3, an flock-guarded compare on a local disk), so of two drivers that find it free, one
takes it and the other looks again.

Is the holder still alive? The lease names it: its machine, pid and the pid's start time.
- Released (its driver ended): free.
- Held on this machine (the same boot, the same pid namespace): the kernel knows. The holder
  lives if a process with its pid and start time does. A driver killed by SIGKILL or the OOM
  killer is replaced at once, by a rerun on the same machine.
- Held on another machine: the holder renews every `ttl_s / knobs.LEASE_RENEWALS_PER_TTL`
  seconds. The contender watches the lease: a renewal means alive (refuse); none for `ttl_s` by the
  contender's own clock means dead (take over). One last renewed more than `2 * ttl_s` ago by
  the contender's wall clock is taken at once (so clocks must agree to within `ttl_s`).

The holder counts its lease valid until `ttl_s` after the start of its last successful renewal,
by its own monotonic clock. A contender waits at least `ttl_s` after it last saw a renewal, so a
holder cut off from storage stops before another driver takes over. Every run-state write asks
`check()` first (no I/O), and a lost lease stops the training at once (`on_lost`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime

import psutil
from pydantic import BaseModel, ConfigDict, ValidationError

from .. import knobs
from ..errors import RunLockedError
from ..storage.fs import Storage
from ..storage.run_state import now

logger = logging.getLogger("ft_train")

LEASE_FILE = "driver_lease.json"

# Leases this process holds (taken, not yet released), by owner id. A lease that names this pid
# but none of these is dead: its release failed, or an earlier process had the same pid.
_held: set[str] = set()


def _machine() -> str:
    """Where a pid means the same process: this boot of this kernel, in this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:  # not Linux: the host name, and its boot
        return f"{socket.gethostname()}/{psutil.boot_time():.0f}"


def _started(pid: int) -> float | None:
    """When process `pid` started (epoch s), or None if there is none (a zombie, killed and
    not yet reaped by its parent, is none)."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None


MACHINE = _machine()


class LeaseDoc(BaseModel):
    model_config = ConfigDict(extra="ignore")

    owner: str  # one id per acquisition
    machine: str
    host: str
    pid: int
    pid_started: float
    holder: str = ""  # what holds it, for people: "flow run 'x' (id)"
    holder_id: str = ""  # the same, for programs: the Prefect flow run's id
    ttl_s: float
    acquired_at: datetime
    renewed_at: datetime
    renewals: int = 0
    released: bool = False

    def describe(self) -> str:
        what = f"{self.holder}, " if self.holder else ""
        return (
            f"{what}pid {self.pid} on {self.host}, since {self.acquired_at:%Y-%m-%d %H:%M:%S} UTC"
        )


class RunLease:
    """The lease of run `name` on `storage`. `acquire()`, then `check()` before every write of
    the run's state, then `release()`."""

    def __init__(
        self,
        storage: Storage,
        name: str,
        holder: str = "",
        holder_id: str = "",
        ttl_s: float | None = None,
        log: Callable[[str], None] = logger.info,
    ):
        ttl_s = knobs.LEASE_TTL_S if ttl_s is None else ttl_s  # read now: a test may set it
        self.storage, self.name, self.ttl_s, self.log = storage, name, ttl_s, log
        self.path = f"{name}/{LEASE_FILE}"
        self.on_lost: Callable[[str], None] | None = None
        self.previous: LeaseDoc | None = None  # the lease as acquire() found it
        self._doc = LeaseDoc(
            owner=uuid.uuid4().hex,
            machine=MACHINE,
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_started=_started(os.getpid()) or 0.0,
            holder=holder,
            holder_id=holder_id,
            ttl_s=ttl_s,
            acquired_at=now(),
            renewed_at=now(),
        )
        self._tag: str | None = None  # the version of the lease we last wrote
        self._valid_until = 0.0  # monotonic
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the driver's side --------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease, waiting up to its ttl for a holder on another machine that may have
        died; raise RunLockedError while another driver holds it."""
        watched: tuple[str, int] | None = None  # (owner, renewals) first seen
        deadline = 0.0
        while True:
            found = self.storage.read_versioned(self.path)
            other, tag = (None, None) if found is None else (parse_lease(found[0]), found[1])
            if found is not None and other is None:
                logger.warning(f"ft-train: {self.path} is not a lease; replacing it")
            if other is not None and not other.released:
                alive = holder_alive(other)
                if alive is None:  # on another machine: watch it for a renewal
                    if watched is None:
                        watched = (other.owner, other.renewals)
                        deadline = time.monotonic() + other.ttl_s
                        self.log(
                            f"run {self.name!r} is held by {other.describe()}; waiting up to "
                            f"{other.ttl_s:g}s for that driver to renew its lease or be gone"
                        )
                    elif (other.owner, other.renewals) != watched:
                        alive = True
                    elif time.monotonic() >= deadline:
                        alive = False
                if alive:
                    raise RunLockedError(
                        f"run {self.name!r} at {self.storage.uri(self.name)} is being trained by "
                        f"another driver ({other.describe()}); wait for it to end or stop it, or "
                        "start a new run with another run_config.name"
                    )
                if alive is None:
                    time.sleep(min(1.0, other.ttl_s / knobs.LEASE_RENEWALS_PER_TTL))
                    continue
                self.log(
                    f"taking over the lease of run {self.name!r} from {other.describe()}: "
                    "that driver is gone"
                )
            started = time.monotonic()
            new_tag = self._write_if(tag)
            if new_tag is not None:
                self.previous = other
                break
            # another driver wrote it first: look again
        self._tag, self._valid_until = new_tag, started + self.ttl_s
        self._thread = threading.Thread(target=self._renew, name="ft-train-lease", daemon=True)
        self._thread.start()

    def _write_if(self, tag: str | None) -> str | None:
        """Write our lease if the stored one is still `tag`; its new tag, or None if another
        driver wrote first."""
        self._doc.acquired_at = self._doc.renewed_at = now()
        _held.add(self._doc.owner)  # first: from the write on, our threads see it held
        new_tag = None
        try:
            new_tag = self.storage.write_if(self.path, self._bytes(), tag)
        finally:
            if new_tag is None:
                _held.discard(self._doc.owner)
        return new_tag

    def check(self) -> None:
        """Raise RunLockedError unless this driver still holds the lease. No I/O."""
        if self._lost is None and time.monotonic() >= self._valid_until:
            self._lost = (
                f"lost the lease of run {self.name!r}: could not renew it for {self.ttl_s:g}s "
                "(is the storage reachable?), and another driver may take the run over"
            )
        if self._lost is not None:
            raise RunLockedError(f"{self._lost}; this driver stopped training it")

    def release(self) -> None:
        """Give the lease up, so that the next driver starts at once. Idempotent; best effort
        (a lease not released is taken over as its holder's death allows)."""
        if self._doc.owner not in _held:
            return
        _held.discard(self._doc.owner)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lost is not None:
            return
        self._doc.released = True
        try:
            self.storage.write_if(self.path, self._bytes(), self._tag)
        except Exception as e:
            self.log(f"could not release the lease of run {self.name!r} ({type(e).__name__}: {e})")

    # -- internals ----------------------------------------------------------------------------

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / knobs.LEASE_RENEWALS_PER_TTL) and self._lost is None:
            started = time.monotonic()
            self._doc.renewals += 1
            self._doc.renewed_at = now()
            try:
                tag = self.storage.write_if(self.path, self._bytes(), self._tag)
                if tag is None:  # changed under us; our own renewal whose reply was lost?
                    found = self.storage.read_versioned(self.path)
                    mine = None if found is None else parse_lease(found[0])
                    if found is not None and mine is not None and mine.owner == self._doc.owner:
                        tag = found[1]
            except Exception as e:
                if time.monotonic() < self._valid_until:
                    self.log(
                        f"could not renew the lease of run {self.name!r} "
                        f"({type(e).__name__}: {e}); trying again"
                    )
                    continue
                tag, why = None, f"could not renew it for {self.ttl_s:g}s ({type(e).__name__}: {e})"
            else:
                why = "another driver took the run over"
            if tag is None:
                self._lost = f"lost the lease of run {self.name!r}: {why}"
                if self.on_lost is not None and not self._stop.is_set():
                    self.on_lost(f"{self._lost}; this driver stopped training it")
                return
            self._tag, self._valid_until = tag, started + self.ttl_s  # also when releasing

    def _bytes(self) -> bytes:
        return self._doc.model_dump_json(indent=1).encode()


def holder_alive(doc: LeaseDoc) -> bool | None:
    """Is the driver that wrote lease `doc` alive? None when only its renewals can tell (it is
    on another machine, and renewed it within the last two ttls)."""
    if doc.released:
        return False
    if doc.machine == MACHINE:
        if doc.pid == os.getpid():  # this process, or an earlier one with its pid
            return doc.owner in _held
        started = _started(doc.pid)
        return started is not None and abs(started - doc.pid_started) < 1.0
    age = (now() - doc.renewed_at).total_seconds()
    return False if age > 2 * doc.ttl_s else None


def read_lease(storage: Storage, name: str) -> LeaseDoc | None:
    """Run `name`'s lease as last written, or None if it has none (or not one that parses)."""
    found = storage.read_versioned(f"{name}/{LEASE_FILE}")
    return None if found is None else parse_lease(found[0])


def live_holder(storage: Storage, name: str) -> LeaseDoc | None:
    """The lease of the driver that is training run `name` now, where this machine can tell at
    once (not one on another machine, whose renewals alone can tell); else None."""
    doc = read_lease(storage, name)
    return doc if doc is not None and holder_alive(doc) is True else None


def parse_lease(raw: bytes) -> LeaseDoc | None:
    """The lease in `raw`, or None for one that is not (taken as free, and overwritten)."""
    try:
        return LeaseDoc.model_validate_json(raw)
    except ValidationError:
        return None
