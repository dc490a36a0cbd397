"""Simulated ranks for the control-plane scale benchmark (`bench/scale.py`): no torch, no Dask
cluster, but the real driver side.

What is real: the controller (`ft_train.controller`), the worker group's event handling
(`SimGroup` is a `ft_train.driver.worker_group.WorkerGroup`: its `_spec`, `_on_reports` and
`_on_scheduler_event` are the ones a run uses), the ranks' `Session.report()` with its upload
(`Storage.upload_dir`), journal (`ft_train.worker.journal`, read back with `journal.collect`, as a
nanny does) and wire messages (`protocol`), the run state, its store and the checkpoint manager.

What is simulated:
- a rank is a thread (1 024 of them fit a 2-core machine; asyncio tasks would serialise the
  blocking upload, and a Dask worker per rank does not fit); its training step is a
  `threading.Barrier` across the group (the step's all-reduce). No agreement (the control gloo
  group) runs, so `report()` skips it; each rank trims its journal at every step instead, as
  an agreement lets it;
- the Dask transport: each message a rank sends is one event (no `REPORT_BATCH_S` batching, the
  worst case for the driver), msgpack'd on the rank's thread and unpacked on one receiver thread,
  the driver's Dask client thread; its handling is charged to the driver;
- the scheduler: `lose()` hands the group the `remove-worker` event the scheduler would send
  once it notices a worker gone (that notice itself, a closed connection or `worker-ttl`, is
  not simulated);
- the ranks' pace: a round's reports are held (`Wire`) until every rank has reported it, then
  handed to the driver at once, and the ranks wait until the driver has handled them (and
  committed the round's checkpoint): the driver's work is timed while no rank thread competes
  with it for the GIL, as no rank process does in a run. A burst of a whole round's reports is
  also the worst case for the commit's latency;
- gloo: when the group is stopped, the surviving ranks' barrier breaks, as the collectives of a
  group whose peer is gone do, and the ranks end with "Connection closed by peer".
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ft_train.controller.ports import GroupPlan
from ft_train.driver.worker_group import WorkerGroup
from ft_train.errors import RankFailure
from ft_train.protocol import GroupEvent, Message, RankEnded, RankSpec, Started
from ft_train.snapshots.piece import SnapshotPiece
from ft_train.storage.checkpoint import Checkpoint
from ft_train.worker import journal
from ft_train.worker.journal import Journal, run_key
from ft_train.worker.session import Session

RANKS_PER_HOST = 8  # the simulated workers' hosts: node_rank, local_rank, journal reads


@dataclass
class Script:
    """What every rank of a group does: `rounds` is one letter per report, "m" (metrics only) or
    "c" (with a checkpoint of one `file_bytes` file per rank); `die` = (rank, round): that rank's
    process dies before it reports that round (0-based), silently."""

    rounds: str
    file_bytes: int = 1024
    die: tuple[int, int] | None = None


@dataclass
class Timings:
    """What the ranks record (time.monotonic), by report index."""

    started: dict[int, float] = field(default_factory=dict)  # the round's step ended
    sent: dict[int, float] = field(default_factory=dict)  # its reports handed to the driver
    died: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    committed: dict[int, threading.Event] = field(default_factory=dict)
    driver_cpu: dict[int, float] = field(default_factory=dict)  # the driver's, once it is done

    def commit_of(self, index: int) -> threading.Event:
        with self.lock:
            return self.committed.setdefault(index, threading.Event())


_Item = tuple[Callable[[Any], None], bytes]


class Wire:
    """The Dask transport, simulated: one receiver thread (the driver's client thread) runs
    every handler, in arrival order. What the ranks send is held until `release()`: a round's
    reports reach the driver at once, while no rank thread runs."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self.held: list[_Item] = []
        self.pending = 0  # released, not yet handled
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._receive, name="sim-dask-client", daemon=True)
        self.thread.start()

    def send(self, handler: Callable[[Any], None], payload: Any, hold: bool = True) -> None:
        """On the sender's thread: serialise, as a worker does before the scheduler sees it."""
        item = (handler, msgpack.packb(payload))
        with self.lock:
            self.pending += not hold
            if hold:
                self.held.append(item)
            else:
                self.inbox.put(item)

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held, []
            self.pending += len(held)
            for item in held:
                self.inbox.put(item)

    def drained(self) -> bool:
        return self.pending == 0

    def _receive(self) -> None:
        while (item := self.inbox.get()) is not None:
            handler, raw = item
            handler(msgpack.unpackb(raw))
            with self.lock:
                self.pending -= 1

    def driver_cpu_s(self, controller: int) -> float:
        """CPU time so far of the driver's threads: the receiver and `controller` (an ident)."""
        assert self.thread.ident is not None
        return sum(
            time.clock_gettime(time.pthread_getcpuclockid(t))
            for t in (self.thread.ident, controller)
        )

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(5)


class _Died(BaseException):
    """The rank's process died: it says nothing more."""


class SimCluster:
    """`controller.ports.Cluster` over simulated workers, `RANKS_PER_HOST` to a host."""

    def __init__(self, workers: int, script: Script, local_root: str):
        self.workers = [
            f"tcp://10.0.{i // RANKS_PER_HOST}.{i % RANKS_PER_HOST}:1" for i in range(workers)
        ]
        self.gone: set[str] = set()
        self.script, self.local_root = script, local_root
        self.wire = Wire()
        self.timings = Timings()
        self.groups: list[SimGroup] = []
        self.controller = threading.get_ident()  # the thread that steps the controller

    def new_group(self, attempt: int, events: queue.Queue[GroupEvent], run_uri: str) -> SimGroup:
        self.groups.append(SimGroup(self, attempt, events, run_uri))
        return self.groups[-1]

    def alive(self) -> set[str]:
        return set(self.workers) - self.gone

    def can_grow(self, plan: GroupPlan, current: list[str], exclude: set[str]) -> bool:
        return False

    def watch_preemption(self, notice_s: float) -> None:
        pass

    def warm(self, modules: tuple[str, ...]) -> None:
        pass

    def hold_snapshots(self) -> None:
        pass  # snapshots off in the benchmark (CheckpointConfig.snapshot_every=None)

    def held_snapshots(self, run_uri: str) -> list[SnapshotPiece]:
        return []

    def drop_snapshots(self, run_uri: str) -> None:
        pass

    def close(self) -> None:
        for group in self.groups:
            group.stop()
        self.wire.close()


class SimGroup(WorkerGroup):
    """A `WorkerGroup` whose ranks are threads: its Dask calls are replaced, its event handling
    is the real one."""

    def __init__(
        self, cluster: SimCluster, attempt: int, events: queue.Queue[GroupEvent], run_uri: str
    ):
        super().__init__(None, attempt, events, run_uri)  # type: ignore[arg-type]  # no Dask
        self.cluster = cluster
        self.threads: list[threading.Thread] = []
        self.dead: set[int] = set()
        self.step = self.end = threading.Barrier(1)
        self.round: tuple[int, str] = (0, "m")  # the round ending (every rank sets the same)
        self.stop_s = self.journals_s = 0.0  # how long stop() and read_journals() took

    def place(self, plan: GroupPlan, exclude: set[str]) -> None:
        usable = [
            w for w in self.cluster.workers if w not in exclude and w not in self.cluster.gone
        ]
        self.addresses = usable[: plan.max_workers]

    def start(
        self,
        plan: GroupPlan,
        checkpoint_dir: str | None,
        start_report_index: int,
        snapshot: Any = None,
    ) -> None:
        self.hosts = {a: a.split("://")[1].rsplit(".", 1)[0] for a in self.addresses}
        self.nannies = dict.fromkeys(self.addresses)
        self.step = threading.Barrier(len(self.addresses))
        self.end = threading.Barrier(len(self.addresses), action=self._round_end)
        for rank in range(len(self.addresses)):
            spec = self._spec(plan, rank, ("127.0.0.1", 0), checkpoint_dir, start_report_index)
            thread = threading.Thread(target=self._rank, args=(spec,), name=f"rank-{rank}")
            self.threads.append(thread)
        for thread in self.threads:
            thread.start()

    # -- a rank ---------------------------------------------------------------------------------

    def _rank(self, spec: RankSpec) -> None:
        """What `ft_train.worker.rank.run_rank` does, with a barrier for torch."""
        rank, wire = spec.rank, self.cluster.wire

        def send(msg: Message) -> None:
            wire.send(self._on_reports, ("ts", [msg.wire()]))

        jrnl = Journal(run_key(self.storage_uri), spec.attempt_id, rank)
        session = Session(spec, send, jrnl)
        ended: RankEnded | None = None
        try:
            jrnl.joined(spec.start_report_index)
            send(Started(rank))
            self._loop(spec, session, jrnl)
            ended = RankEnded(
                self.attempt, rank, summary={"rank": rank, "reports": session.report_index}
            )
        except _Died:
            self.dead.add(rank)
            self.cluster.timings.died.set()
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            failure = RankFailure(rank, session.report_index, error, traceback.format_exc(limit=-5))
            ended = RankEnded(self.attempt, rank, error=failure)
        finally:
            session.close()
            jrnl.close()
        if ended is not None:  # the task's future ends: its callback runs on the client thread
            wire.send(lambda _, e=ended: self.events.put(e), None, hold=False)

    def _loop(self, spec: RankSpec, session: Session, jrnl: Journal) -> None:
        script, timings = self.cluster.script, self.cluster.timings
        local = os.path.join(self.cluster.local_root, f"a{self.attempt}-r{spec.rank}")
        os.makedirs(local, exist_ok=True)
        for i, kind in enumerate(script.rounds):
            if script.die == (spec.rank, i) or spec.rank in self.dead:
                raise _Died()
            self._collective(self.step, spec.rank)  # the step's all-reduce
            # Every rank reached the last report: what the ranks' agreement tells them every few
            # reports in a run (`Session._read_agreement`), which keeps their journals short.
            jrnl.all_reached(session.report_index)
            index = session.report_index + 1
            if spec.rank == 0:
                self.round = (index, kind)
                timings.started[index] = time.monotonic()
            metrics = {"loss": 1.0 / index, "step": index}
            if kind == "c":
                with open(os.path.join(local, f"rank{spec.rank}.pt"), "wb") as f:
                    f.write(os.urandom(script.file_bytes))
                session.report(metrics, checkpoint=Checkpoint.from_directory(local))
            else:
                session.report(metrics)
            self._collective(self.end, spec.rank)

    def _collective(self, barrier: threading.Barrier, rank: int) -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            if rank in self.dead:  # killed by the driver
                raise _Died() from None
            raise ConnectionError("Connection closed by peer") from None

    def _round_end(self) -> None:
        """Every rank has reported the round (on the last one's thread, the others waiting):
        hand its reports to the driver, and wait until it has handled them (and committed the
        round's checkpoint). The driver is a process of its own in a run: while it works, these
        threads must not hold the GIL it needs, or they would time this machine's scheduler."""
        index, kind = self.round
        wire, timings = self.cluster.wire, self.cluster.timings
        timings.sent[index] = time.monotonic()
        wire.release()
        committed = timings.commit_of(index)
        # Woken by the commit, else polled seldom: each wake-up takes the GIL from the driver.
        while kind == "c" and not committed.wait(0.05):
            if self.stopped:
                return
        while not (wire.drained() and self.events.empty()):
            if self.stopped:
                return
            time.sleep(0.005)
        timings.driver_cpu[index] = wire.driver_cpu_s(self.cluster.controller)

    # -- the scheduler --------------------------------------------------------------------------

    def lose(self, rank: int) -> None:
        """The scheduler removed rank `rank`'s worker: its `remove-worker` event, as Dask sends it."""
        address = self.addresses[rank]
        self.cluster.gone.add(address)
        event = {"action": "remove-worker", "worker": address, "expected": False}
        self.cluster.wire.send(self._on_scheduler_event, ("ts", event), hold=False)

    # -- the Group protocol, without Dask -------------------------------------------------------

    def stop(self, grace_s: float = 0.0, kill_first: Collection[str] = ()) -> set[str]:
        if self.stopped:
            return set()
        self.stopped = True
        began = time.monotonic()
        killed = set(kill_first)
        self.dead |= {self.addresses.index(a) for a in killed if a in self.addresses}
        self.step.abort()  # gloo: the surviving ranks see their peers' connections close
        self.end.abort()
        deadline = time.monotonic() + grace_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = {a for a, t in zip(self.addresses, self.threads, strict=True) if t.is_alive()}
        self.stop_s = time.monotonic() - began
        return stuck | killed | (set(self.addresses) - self.cluster.alive())

    def read_journals(self, skip: Collection[str] = ()) -> dict[int, dict[str, Any]]:
        """What each node's nanny returns (`journal.collect`); the ranks of one host, all the
        hosts here, are on one machine, so one call reads them all."""
        began = time.monotonic()
        found = journal.collect(run_key(self.storage_uri), self.attempt_id)
        skipped = {self.addresses.index(a) for a in skip if a in self.addresses}
        self.journals_s += time.monotonic() - began
        return {r: j for r, j in found.items() if r not in skipped}

    def request_stop(self) -> None:
        raise NotImplementedError("the benchmark never resizes")

    def give_notice(self, address: str, deadline: float) -> None:
        raise NotImplementedError("the benchmark never preempts")

    def release(self) -> None:
        for thread in self.threads:
            thread.join(5)

    def lost_kind(self, address: str) -> str:
        return "process_death"  # its nanny answers: the journal of its node is there
