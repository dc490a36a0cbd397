"""Preemption: a worker told to leave gives its ranks notice before it goes.

The `PreemptionWatcher` worker plugin replaces the worker's SIGTERM handler: instead of closing
at once, the worker notes a deadline (now + grace), tells the driver, and closes itself at the
deadline unless the driver has released it sooner. A worker retired through the scheduler
(`Client.retire_workers`) gets the same notice: the driver sends it when the scheduler reports
the worker's removal, and the plugin's teardown keeps the closing worker's process until its
rank has left or the notice runs out. Every rank learns of the notice at the same
`report()` boundary: reports all-reduce the ranks' local notices over a small gloo group,
so the training function can save a just-in-time checkpoint that is committed before the worker
leaves. The restart that follows is charged to `max_preemption_failures`, not `max_failures`.

The same agreement carries the driver's request to stop a healthy group (`request_stop`, used to
grow an elastic group): every rank then leaves its training function at the same report, and
keeps its process. `report()` starts the agreement in the background and reads it at the next
report, so what the ranks learn at report k+1 is what they knew at report k; with reports close
together, only every few reports (`FailureConfig.agreement_interval_s`, `session._start_agreement`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger("ft_train")

TOPIC = "ft-train-preemption"

# This process's notice: the epoch time by which its worker leaves. Set by the signal handler.
_deadline: Optional[float] = None
# The attempt whose ranks the driver asked to stop (they all leave at the same later report).
_stop_for: Optional[str] = None


class GroupStop(BaseException):
    """Raised by report() on every rank of a group the driver stopped; not an Exception, so a
    training function's `except Exception` does not swallow it."""


def give_notice(deadline: float) -> None:
    """Run on a worker (also by Client.run): the ranks learn, one report() later, that this
    worker leaves by `deadline` (epoch seconds)."""
    global _deadline
    _deadline = deadline if _deadline is None else min(_deadline, deadline)


def request_stop(attempt_id: str) -> None:
    """Run on a worker (Client.run): the ranks leave at a later report(), all at the same one."""
    global _stop_for
    _stop_for = attempt_id


@dataclass(frozen=True)
class PreemptionInfo:
    """What `ft_train.get_preemption_info()` returns once the group has been given notice."""

    ranks: tuple[int, ...]  # the ranks whose workers are leaving
    deadline: float  # epoch seconds by which the first of them leaves


def local_deadline() -> Optional[float]:
    return _deadline


class PreemptionWatcher(WorkerPlugin):
    """Installed on every worker of the run's cluster (and on workers that join later)."""

    name = "ft-train-preemption"

    def __init__(self, grace_s: float):
        self.grace_s = grace_s

    def setup(self, worker) -> None:
        def on_sigterm(signum, frame) -> None:
            # A signal handler: no logging here; hand the work to the event loop.
            if _deadline is None:
                give_notice(time.time() + self.grace_s)
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
        from . import session

        if session._session is None:
            return
        if _deadline is None:
            give_notice(time.time() + self.grace_s)
            worker.log_event(TOPIC, {"worker": worker.address, "deadline": _deadline})
        while session._session is not None and time.time() < _deadline:
            await asyncio.sleep(0.02)
        if session._session is not None:
            os._exit(0)

    async def _notice(self, worker, deadline: float) -> None:
        worker.log_event(TOPIC, {"worker": worker.address, "deadline": deadline})
        await asyncio.sleep(max(0.0, deadline - time.time()))  # the grace period, then leave
        await worker.close(reason="preempted")


@dataclass(frozen=True)
class Agreement:
    """What every rank learns at the same report(), from one all-reduce."""

    preemption: Optional[PreemptionInfo]
    stop: bool  # the driver asked the group to stop
    any_finished: bool  # some rank has returned from its training function
    all_finished: bool
    every: int  # the next agreement starts this many reports later
    same_index: bool  # every rank started it at the same report index


class PendingAgreement:
    """One agreement: the ranks' flags, all-reduced (MAX) in the background over the control
    group; `result()` waits for it. Every rank starts one at the same report index, so every
    rank reads the same one. `every`: this rank's proposal for how many reports later the next
    one starts (the group takes the largest)."""

    def __init__(
        self, control_group, rank: int, world_size: int, attempt_id: str, finished: bool,
        every: int = 1, index: int = 0,
    ):
        import torch
        import torch.distributed as dist

        w = self.world_size = world_size
        flags = [0.0] * (w + 7)  # a list first: a tensor's item assignments cost ~10 us each
        flags[w] = float("-inf") if _deadline is None else -_deadline  # -earliest deadline
        if _deadline is not None:
            flags[rank] = 1.0
        flags[w + 1] = 1.0 if _stop_for == attempt_id else 0.0
        flags[w + 2] = 1.0 if finished else 0.0  # any rank finished
        flags[w + 3] = 0.0 if finished else 1.0  # any rank not finished
        flags[w + 4] = float(every)
        flags[w + 5], flags[w + 6] = float(index), -float(index)  # the highest and the lowest
        self.flags = torch.tensor(flags, dtype=torch.float64)
        self.work = None
        if w > 1:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX
            # a ProcessGroup or a bare gloo backend (`rank._control_group`): both take this call
            self.work = control_group.allreduce([self.flags], options)

    def result(self) -> Agreement:
        if self.work is not None:
            self.work.wait()  # also raises the all-reduce's error (a peer lost)
        w, flags = self.world_size, self.flags.tolist()
        ranks = tuple(r for r in range(w) if flags[r])
        info = PreemptionInfo(ranks, -flags[w]) if ranks else None
        return Agreement(
            info, bool(flags[w + 1]), bool(flags[w + 2]), not flags[w + 3],
            every=int(flags[w + 4]), same_index=flags[w + 5] == -flags[w + 6],
        )


def agree(
    control_group, rank: int, world_size: int, attempt_id: str, finished: bool = False,
    index: int = 0,
) -> Agreement:
    """The agreement, waited for."""
    return PendingAgreement(
        control_group, rank, world_size, attempt_id, finished, index=index
    ).result()
