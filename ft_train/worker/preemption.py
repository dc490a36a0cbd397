"""Preemption: a worker told to leave gives its ranks notice before it goes.

The `PreemptionWatcher` worker plugin replaces the worker's SIGTERM handler: instead of closing
at once, the worker notes a deadline (now + `FailureConfig.preemption_notice_s`), tells the
driver, and closes itself at the deadline unless the driver has released it sooner. A worker
retired through the scheduler (`Client.retire_workers`) gets the same notice: the driver sends it
when the scheduler reports the worker's removal, and the plugin's teardown keeps the closing
worker's process until its rank has left or the notice runs out. Every rank learns of the notice
at the same call of `report()` or `get_preemption_info()`: these calls all-reduce the ranks'
local notices over a small gloo group, so the training function can save a just-in-time
checkpoint that is committed before the worker leaves. The restart that follows is charged to
`max_preemption_failures`, not `max_failures`.

The same agreement carries the driver's request to stop a healthy group (`request_stop`, used to
grow an elastic group): every rank then leaves its training function at the same call, and
keeps its process. A call starts the agreement in the background and the next call reads it, so
what the ranks learn at call k+1 is what they knew at call k; with calls close together, only
every few calls (`FailureConfig.agreement_interval_s`, `ft_train.worker.session`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from distributed.diagnostics.plugin import WorkerPlugin

from ..protocol import Agreement, decode_flags, encode_flags

logger = logging.getLogger("ft_train")

TOPIC = "ft-train-preemption"

# This process's notice: the epoch time by which its worker leaves. Set by the signal handler.
_deadline: float | None = None
# The attempt whose ranks the driver asked to stop (they all leave at the same later report).
_stop_for: str | None = None
# Is a rank's training function running in this process (`session.install` says)?
_rank_running = False


def rank_running(running: bool) -> None:
    global _rank_running
    _rank_running = running


class GroupStop(BaseException):
    """Raised by report() on every rank of a group the driver stopped; not an Exception, so a
    training function's `except Exception` does not swallow it."""


def give_notice(deadline: float) -> float:
    """Run on a worker (also by Client.run): the ranks learn, one report() later, that this
    worker leaves by `deadline` (epoch seconds). Returns the deadline now in force."""
    global _deadline
    _deadline = deadline if _deadline is None else min(_deadline, deadline)
    return _deadline


def request_stop(attempt_id: str) -> None:
    """Run on a worker (Client.run): the ranks leave at a later report(), all at the same one."""
    global _stop_for
    _stop_for = attempt_id


def local_deadline() -> float | None:
    return _deadline


class PreemptionWatcher(WorkerPlugin):
    """Installed on every worker of the run's cluster (and on workers that join later)."""

    name = "ft-train-preemption"

    def __init__(self, notice_s: float):
        self.notice_s = notice_s

    def setup(self, worker) -> None:
        def on_sigterm(signum, frame) -> None:
            # A signal handler: no logging here; hand the work to the event loop.
            if _deadline is None:
                give_notice(time.time() + self.notice_s)
                worker.loop.add_callback(self._notice, worker, _deadline)

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
        except ValueError:  # not the main thread (an in-process worker): no notice possible
            logger.debug("cannot watch SIGTERM on worker %s", worker.address)

    async def teardown(self, worker) -> None:
        """The worker is closing: retired (`Client.retire_workers`), or its notice ran out.
        A rank still running here gets the same notice as on SIGTERM, and the process stays
        until the rank has left or the notice runs out (Dask waits for this teardown before it
        stops the worker). A rank still running then could never report again and would hold
        its peers in their collectives: end the process, so they see the closed connection."""
        if not _rank_running:
            return
        deadline = _deadline
        if deadline is None:
            deadline = give_notice(time.time() + self.notice_s)
            worker.log_event(TOPIC, {"worker": worker.address, "deadline": deadline})
        while _rank_running and time.time() < deadline:
            await asyncio.sleep(0.02)
        if _rank_running:
            os._exit(0)

    async def _notice(self, worker, deadline: float) -> None:
        worker.log_event(TOPIC, {"worker": worker.address, "deadline": deadline})
        await asyncio.sleep(max(0.0, deadline - time.time()))  # the notice, then leave
        await worker.close(reason="preempted")


class PendingAgreement:
    """One agreement: the ranks' flags, all-reduced (MAX) in the background over the control
    group; `result()` waits for it. Every rank starts one at the same agreement point, so every
    rank reads the same one. `every`: this rank's proposal for how many points later the next
    one starts (the group takes the largest). `index`, `kind` and `reports` say which point this
    is (the group checks that every rank is at the same one); `payload`: rank 0's broadcast size
    (`ft_train.collective`)."""

    def __init__(
        self,
        control_group,
        rank: int,
        world_size: int,
        attempt_id: str,
        finished: bool,
        every: int = 1,
        index: int = 0,
        kind: int = 0,
        reports: int = 0,
        payload: int = 0,
    ):
        import torch
        import torch.distributed as dist

        self.world_size = world_size
        stop = _stop_for == attempt_id
        flags = encode_flags(
            rank, world_size, _deadline, stop, finished, every, index, kind, reports, payload
        )
        self.flags = torch.tensor(flags, dtype=torch.float64)
        self.work = None
        if world_size > 1:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch's stubs
            # a ProcessGroup or a bare gloo backend (`compat.torch_distributed.control_group`): both take this call
            self.work = control_group.allreduce([self.flags], options)

    def result(self) -> Agreement:
        if self.work is not None:
            self.work.wait()  # also raises the all-reduce's error (a peer lost)
        return decode_flags(self.flags.tolist(), self.world_size)
