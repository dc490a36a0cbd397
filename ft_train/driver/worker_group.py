"""The worker group: one attempt's ranks on Dask, pinned one per worker.

Each rank is a Dask task pinned to one worker (`workers=[addr]`, `allow_other_workers=False`,
`pure=False`), so Dask never moves or silently re-runs a rank. The group reports everything that
happens to it as events (`ft_train.protocol`) on one thread-safe queue, which the controller
consumes: a rank's messages (Reported), a rank's task ended (RankEnded), the scheduler removed a
worker hosting a rank or heard no heartbeat from it for `worker-ttl` (WorkerLost), a rank's worker
was told to leave (PreemptNotice).
`DaskCluster` is what the controller sees of the cluster (`controller.ports.Cluster`).

Stopping a failed group kills the surviving ranks' worker processes at once (their nannies start
fresh ones): a rank blocked in a collective whose peer died cannot be interrupted any other way,
and waiting for the collective timeout would take up to 30 minutes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any

import dask
from distributed import Client, KilledWorker
from distributed.protocol import pickle

from .. import knobs
from ..compat import dask_broker
from ..controller.ports import GroupPlan
from ..protocol import GroupEvent, PreemptNotice, RankEnded, RankSpec, Reported, WorkerLost, message
from ..snapshots import holders as snapshot_holders
from ..snapshots.piece import SnapshotPiece, SnapshotRound
from ..snapshots.store import SnapshotHolder, SnapshotWorkerHolder
from ..storage.run_state import FailureKind
from ..worker import journal, preemption
from ..worker.journal import run_key
from ..worker.preemption import PreemptionWatcher
from ..worker.rank import run_rank
from ..worker.warm import WarmImports
from .placement import await_workers, more_workers_available

logger = logging.getLogger("ft_train")


async def _hard_exit() -> None:
    os._exit(1)


class WorkerGroup:
    def __init__(
        self, client: Client, attempt: int, events: queue.Queue[GroupEvent], storage_uri: str = ""
    ):
        self.client = client
        self.storage_uri = storage_uri  # the run's, which names its ranks' journals
        self.attempt = attempt
        self.attempt_id = uuid.uuid4().hex
        self.topic = f"ft-train-{self.attempt_id}"
        self.events = events
        self.addresses: list[str] = []  # placed (`place`), in rank order
        self._ports: dict[str, int] = {}  # a free port on each, for the rendezvous
        self._info: dict[str, Any] = {}  # the scheduler's word on each, when placed
        self.nannies: dict[str, str | None] = {}
        self.hosts: dict[str, str] = {}
        self.futures: list = []
        self.stopped = False
        self.placed: set[str] = set()  # the snapshot holders given to ranks (the cluster's set)
        self.dead_holders: set[str] = set()  # snapshot holders gone or silent (the cluster's set)

    def place(self, plan: GroupPlan, exclude: set[str]) -> None:
        self.addresses, self._ports, self._info = await_workers(self.client, plan, exclude)

    def start(
        self,
        plan: GroupPlan,
        checkpoint_dir: str | None,
        start_report_index: int,
        snapshot: SnapshotRound | None = None,
    ) -> None:
        addrs, ports, info = self.addresses, self._ports, self._info
        placed = snapshot_holders.place_holders(addrs, info)
        holders = [tuple(h for h in hs if h not in self.dead_holders) for hs in placed]
        self.placed.update(h for hs in holders for h in hs)
        self.nannies = {a: info[a].get("nanny") for a in addrs}
        self.hosts = {a: info[a]["host"] for a in addrs}
        # Subscribe before submitting: both go to the scheduler on one ordered stream.
        self.client.subscribe_topic(self.topic, self._on_reports)
        self.client.subscribe_topic("all", self._on_scheduler_event)
        self.client.subscribe_topic("scheduler", self._on_scheduler_event)  # worker-ttl's word
        self.client.subscribe_topic(preemption.TOPIC, self._on_preemption_notice)
        self._keep_no_reports()
        master = (self.hosts[addrs[0]], ports[addrs[0]])  # rank 0's worker hosts the rendezvous
        for rank, addr in enumerate(addrs):
            spec = self._spec(plan, rank, master, checkpoint_dir, start_report_index)
            spec.snapshot, spec.snapshot_holders = snapshot, holders[rank]
            gpu = plan.use_gpu and info[addr].get("resources", {}).get("GPU")
            fut = self.client.submit(
                run_rank,
                spec,
                key=f"ft-train-rank-{rank}-{self.attempt_id}",
                workers=[addr],
                allow_other_workers=False,
                pure=False,
                resources={"GPU": 1} if gpu else None,
            )
            fut.add_done_callback(lambda f, r=rank: self.events.put(_ended(self.attempt, r, f)))
            self.futures.append(fut)

    def _keep_no_reports(self) -> None:
        """The scheduler keeps each topic's last 1 000 events for Client.get_events, which nothing
        here reads. Here they are copies of the ranks' reports (an event carries up to half a
        second of them): tens of MB in the driver's process on a local cluster, and, with a
        topic per attempt, every attempt's for good (bench/README.md, Soak)."""
        try:
            self.client.run_on_scheduler(
                _keep_no_events, self.topic, callback_timeout=knobs.ANSWER_TIMEOUT_S
            )
        except Exception:  # a scheduler that runs no functions: only memory is kept
            pass

    def _spec(
        self,
        plan: GroupPlan,
        rank: int,
        master: tuple[str, int],
        checkpoint_dir: str | None,
        start_report_index: int,
    ) -> RankSpec:
        """What rank `rank` is started with: its place among the group's hosts and workers."""
        hosts = sorted(set(self.hosts.values()))
        host = self.hosts[self.addresses[rank]]
        on_host = [a for a in self.addresses if self.hosts[a] == host]
        return RankSpec(
            train_loop=plan.train_loop,
            config=plan.config,
            rank=rank,
            world_size=len(self.addresses),
            local_rank=on_host.index(self.addresses[rank]),
            local_world_size=len(on_host),
            node_rank=hosts.index(host),
            name=plan.name,
            attempt=self.attempt,
            attempt_id=self.attempt_id,
            master_addr=master[0],
            master_port=master[1],
            backend="nccl" if plan.use_gpu else "gloo",
            use_gpu=plan.use_gpu,
            storage=plan.storage,
            checkpoint_dir=checkpoint_dir,
            start_report_index=start_report_index,
            topic=self.topic,
            collective_timeout_s=plan.collective_timeout_s,
            agreement_interval_s=plan.agreement_interval_s,
            snapshot_every=plan.snapshot_every,
        )

    def _on_reports(self, event: tuple) -> None:
        for msg in event[1]:  # a rank's batch (rank.DaskSender)
            self.events.put(Reported(self.attempt, message(msg)))

    def _on_scheduler_event(self, event: tuple) -> None:
        msg = event[1]
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "remove-worker" and msg.get("worker") in self.addresses:
            # expected: the worker was retired or closed on purpose (Client.retire_workers)
            expected = bool(msg.get("expected"))
            self.events.put(WorkerLost(self.attempt, msg["worker"], expected))
        elif msg.get("action") == "worker-ttl-timed-out":
            # No heartbeat for worker-ttl: its host is cut off or frozen. The scheduler removes
            # such a worker at once only without a nanny; with one, it first asks the nanny to
            # restart it, which on a host cut off never answers: the removal comes 30 s later
            # (the restart's timeout, or the TCP timeout), not within worker-ttl.
            for address in set(msg.get("workers", ())) & set(self.addresses):
                self.events.put(WorkerLost(self.attempt, address, expected=False))

    def _on_preemption_notice(self, event: tuple) -> None:
        msg = event[1]
        self.events.put(PreemptNotice(self.attempt, msg["worker"], msg["deadline"]))

    def lost_kind(self, address: str) -> FailureKind:
        """A removed worker whose nanny still answers lost its process; otherwise its node, and
        the snapshots its nanny (or, without one, the worker) held: it is not asked again."""
        nanny = self.nannies.get(address)
        if nanny and "://" in nanny:
            host, port = nanny.split("://", 1)[1].rsplit(":", 1)
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
                return FailureKind.PROCESS_DEATH
            except OSError:
                pass
        self.dead_holders.add(nanny or address)
        return FailureKind.NODE_LOSS

    def read_journals(self, skip: Collection[str] = ()) -> dict[int, dict[str, Any]]:
        """The journals of this attempt's ranks (`ft_train.worker.journal`), once the group has
        stopped: rank -> {"index": the last report that returned, "messages": [...]}. Read
        through each node's nanny, which outlives its worker, all nodes at once; a node whose
        nanny is gone or silent within knobs.ANSWER_TIMEOUT_S (a lost node), and those in `skip`, are
        left out: what their ranks sent is all there is. A worker without a nanny is asked
        itself, if it still runs."""
        key = run_key(self.storage_uri)
        where: dict[str, str] = {}  # host -> whom to ask there: one answer has all its ranks
        for a in sorted(self.addresses, key=lambda a: self.nannies.get(a) is None):
            if a not in skip:
                where.setdefault(self.hosts[a], self.nannies.get(a) or a)

        async def read(addr: str) -> dict[int, dict[str, Any]]:
            call = self.client.rpc(addr).run(
                function=pickle.dumps(journal.collect), args=pickle.dumps((key, self.attempt_id))
            )
            try:
                answer = await asyncio.wait_for(call, knobs.ANSWER_TIMEOUT_S)
            except (TimeoutError, OSError):
                return {}  # gone, or frozen: its node's journals are lost with it
            if answer.get("status") != "OK":  # its function raised: logged on that node
                return {}
            return answer["result"]

        async def read_all() -> list[dict[int, dict[str, Any]]]:
            return await asyncio.gather(*(read(a) for a in where.values()))

        found: dict[int, dict[str, Any]] = {}
        with dask.config.set({"distributed.comm.timeouts.connect": knobs.KILL_CONNECT_TIMEOUT}):
            for answer in self.client.sync(read_all):
                found.update(answer)
        return found

    def request_stop(self) -> None:
        """Ask every rank to leave its training function (at the same later report, all of them)."""
        self._run_bounded(preemption.request_stop, self.attempt_id, workers=self.addresses)

    def release(self) -> None:
        """Forget the group after a clean finish."""
        self._unsubscribe()
        self.futures = []

    def stop(self, grace_s: float = 0.0, kill_first: Collection[str] = ()) -> set[str]:
        """Stop every rank. Returns the addresses of workers killed or lost (not to be reused).

        `kill_first`: the worker of a rank that raised or hung, or workers leaving after a
        notice. Their processes still hold the ranks' collective connections (they close only
        when the process exits), so they are killed first; the other ranks then fail on their
        own at once, as gloo sees the closed connections. Ranks that have not ended within
        `grace_s` are stuck (e.g. in a collective whose peer vanished without a word): their
        processes are killed too. A killed worker's nanny starts a fresh one; workers whose rank
        ended keep their process (and its imported torch) for the next attempt.
        """
        if self.stopped:
            return set()
        self.stopped = True
        self._unsubscribe()
        killed = set(kill_first)
        if killed:
            self.kill(list(killed), only_known=False)
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        # A rank whose worker is gone never ends: its task waits for that worker in vain.
        running = [(a, f) for a, f in zip(self.addresses, self.futures) if a in alive - killed]
        deadline = time.monotonic() + grace_s
        while not all(f.done() for _, f in running) and time.monotonic() < deadline:
            time.sleep(0.01)  # bounded by grace_s; the ones still running are killed below
        stuck = [a for a, f in running if not f.done()]
        if stuck:
            self.kill(stuck)
        self.client.cancel(self.futures, force=True)
        self.futures = []
        return set(stuck) | killed | (set(self.addresses) - alive)

    def give_notice(self, address: str, deadline: float) -> None:
        """Tell a worker's ranks that it leaves by `deadline`: for a worker the scheduler has
        already let go (retired), whose process still runs a rank."""
        self._run_bounded(preemption.give_notice, deadline, workers=[address])

    def kill(self, addresses: list[str], only_known: bool = True) -> None:
        """Exit the workers' processes now: `_hard_exit` runs in their event loop, so it works
        even while a rank's thread is blocked. A worker that is already gone is no error, nor is
        one that does not answer within knobs.ANSWER_TIMEOUT_S (its event loop does not run: the
        scheduler drops it after `worker-ttl`, and the caller does not use it again).
        `only_known=False` also reaches workers the scheduler no longer lists (retired ones)."""
        if only_known:
            alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
            addresses = [a for a in addresses if a in alive]
        if not addresses:
            return
        self._run_bounded(_hard_exit, workers=addresses, wait=False)

    def _run_bounded(self, fn: Callable, *args: Any, workers: list[str], wait: bool = True) -> None:
        """`fn(*args)` on the workers' event loops, giving up on those that are gone or do not
        answer within knobs.ANSWER_TIMEOUT_S (the scheduler's own signals, or the watchdog, tell the
        controller about them)."""
        with dask.config.set({"distributed.comm.timeouts.connect": knobs.KILL_CONNECT_TIMEOUT}):
            try:
                self.client.run(
                    fn,
                    *args,
                    workers=workers,
                    wait=wait,
                    on_error="ignore",
                    callback_timeout=knobs.ANSWER_TIMEOUT_S,
                )
            except TimeoutError:
                logger.warning("ft-train: workers %s did not answer %s", workers, fn.__name__)

    def _unsubscribe(self) -> None:
        for topic in (self.topic, "all", "scheduler", preemption.TOPIC):
            try:
                self.client.unsubscribe_topic(topic)
            except Exception:  # the client may be closing; nothing is left to unsubscribe from
                pass


def _keep_no_events(topic: str, dask_scheduler=None) -> None:
    """On the scheduler: keep none of `topic`'s events once they are sent to the subscribers."""
    dask_broker.keep_no_events(dask_scheduler, topic)


def _ended(attempt: int, rank: int, future) -> RankEnded:
    """A rank's task ended (on the client's callback thread): what the controller needs of it."""
    if future.status == "cancelled":
        return RankEnded(attempt, rank, cancelled=True)
    if future.status == "finished":
        try:
            return RankEnded(attempt, rank, summary=future.result())
        except Exception as e:  # its worker went before the result was fetched
            return RankEnded(attempt, rank, error=e, worker_died=True)
    error = future.exception()
    return RankEnded(attempt, rank, error=error, worker_died=isinstance(error, KilledWorker))


class DaskCluster:
    """What the controller sees of a Dask cluster (`controller.ports.Cluster`)."""

    def __init__(self, client: Client):
        self.client = client
        # Holders given to ranks: a holder whose worker the scheduler dropped (its nanny is
        # restarting it) is asked too, though not listed until the new worker joins.
        self.placed: set[str] = set()
        self.dead_holders: set[str] = set()  # not asked again (`ft_train.snapshots.holders`)

    def new_group(self, attempt: int, events, run_uri: str) -> WorkerGroup:
        group = WorkerGroup(self.client, attempt, events, run_uri)
        group.placed, group.dead_holders = self.placed, self.dead_holders
        return group

    def alive(self) -> set[str]:
        return set(self.client.scheduler_info(n_workers=-1)["workers"])

    def can_grow(self, plan: GroupPlan, current: list[str], exclude: set[str]) -> bool:
        return more_workers_available(self.client, plan, current, exclude)

    def watch_preemption(self, notice_s: float) -> None:
        # waited for: without it no worker gets notice of its preemption
        self._register(PreemptionWatcher(notice_s), knobs.ANSWER_TIMEOUT_S, logger.warning)

    def warm(self, modules: tuple[str, ...]) -> None:
        # the run may be over before it is done: no matter, the workers only start cold
        self._register(WarmImports(modules), 0.0, logger.debug)

    def hold_snapshots(self) -> None:
        # not waited for: the first snapshot comes after the ranks' start, which takes longer
        self._register(SnapshotHolder(), 0.0, logger.warning)
        self._register(SnapshotWorkerHolder(), 0.0, logger.warning)

    def held_snapshots(self, run_uri: str) -> list[SnapshotPiece]:
        return snapshot_holders.held(self.client, run_key(run_uri), self.placed, self.dead_holders)

    def drop_snapshots(self, run_uri: str) -> None:
        snapshot_holders.drop(self.client, run_key(run_uri), self.placed, self.dead_holders)

    def _register(self, plugin, wait_s: float, failed) -> None:
        """Register a worker plugin, waiting up to `wait_s` for it. The scheduler keeps it for
        the workers that join later at once, then hands it to every worker in one broadcast,
        which a frozen worker holds until the scheduler drops it (worker-ttl): so on a thread.
        The workers that answer have it within milliseconds."""

        def register() -> None:
            try:
                self.client.register_plugin(plugin)
            except Exception as e:
                failed(f"ft-train: could not register {plugin.name} ({type(e).__name__}: {e})")

        thread = threading.Thread(target=register, name=plugin.name, daemon=True)
        thread.start()
        thread.join(wait_s)
