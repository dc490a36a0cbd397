"""Runs the user's callbacks (`RunConfig.callbacks`, `ft_train.UserCallback`) off the
controller's thread.

`UserCallbacks` is one controller `Callback` (`ft_train.controller.callbacks`) that turns what
the controller tells into the user's hooks and hands each to every user callback's own queue:
the controller's cost is an append under a lock, whatever the callbacks do. Each user callback
has its own thread, so a slow tracker delays neither failure detection, a commit, nor another
callback. The queue is bounded in reports (`knobs.CALLBACK_QUEUED_REPORTS`): a callback that
cannot keep up loses the oldest reports, with a warning; checkpoints, failures and the run's end
are never dropped. A hook that raises is logged once per hook (then counted), and never fails
the run. At the run's end, `close` waits up to `knobs.CALLBACK_DRAIN_S` for the queues to
empty, then leaves a callback still busy to its (daemon) thread.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .. import knobs
from ..callbacks import TrainRunContext, UserCallback
from ..controller.callbacks import Callback
from ..errors import RankError
from ..policy.failure import retries_left
from ..storage.checkpoint import Checkpoint
from ..storage.fs import Storage
from ..storage.run_state import CheckpointEntry, FailureRecord, RunState

if TYPE_CHECKING:
    from ..config import ScalingConfig
    from .prepare import RunPlan

logger = logging.getLogger("ft_train")

__all__ = ["CallbackThread", "UserCallbacks"]


class CallbackThread:
    """One user callback, its queue of hook calls and the thread that makes them in order."""

    def __init__(self, callback: UserCallback, max_reports: int):
        self.callback, self.max_reports = callback, max_reports
        self.name = type(callback).__name__
        self._queue: deque[tuple[str, dict[str, Any], bool]] = deque()
        self._reports = 0  # droppable events queued
        self._busy = self._closing = self._abandoned = False
        self._cond = threading.Condition()
        self.dropped = 0
        self.errors: dict[str, int] = {}  # hook -> how many times it raised
        self.takes_index = _accepts(callback.after_report, "report_index")
        self._thread = threading.Thread(
            target=self._loop, name=f"ft-train callback {self.name}", daemon=True
        )
        self._thread.start()

    def put(self, hook: str, kwargs: dict[str, Any], droppable: bool = False) -> None:
        """Queue a hook call; never blocks for longer than the lock (the controller calls it)."""
        with self._cond:
            if self._closing:
                return
            if droppable and self._reports >= self.max_reports:
                self._drop_oldest_report()
            self._queue.append((hook, kwargs, droppable))
            self._reports += droppable
            self._cond.notify()

    def close(self, deadline: float) -> int:
        """Stop taking events and wait until `deadline` (monotonic) for the queued ones to be
        delivered; returns how many were not (the thread then drops them)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            left = len(self._queue) + self._busy
            self._abandoned = True
            self._queue.clear()
            self._cond.notify_all()
        return left

    def _drop_oldest_report(self) -> None:
        for i, (_, _, droppable) in enumerate(self._queue):
            if droppable:
                del self._queue[i]
                self._reports -= 1
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning(
                        "ft-train: callback %s is slower than the run's reports: more than %d "
                        "wait for it; the oldest are dropped (it does not delay training)",
                        self.name,
                        self.max_reports,
                    )
                return

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue or self._abandoned:
                    return
                hook, kwargs, droppable = self._queue.popleft()
                self._reports -= droppable
                self._busy = True
            try:
                getattr(self.callback, hook)(**kwargs)
            except Exception as e:  # a callback watches the run: it never changes the run
                self._failed(hook, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _failed(self, hook: str, error: Exception) -> None:
        self.errors[hook] = self.errors.get(hook, 0) + 1
        if self.errors[hook] == 1:
            logger.warning(
                "ft-train: callback %s.%s raised %s: %s; the run goes on (later errors of this "
                "hook are counted, and summed up at the run's end)",
                self.name,
                hook,
                type(error).__name__,
                error,
                exc_info=error,
            )


class UserCallbacks(Callback):
    """The controller's subscriber that hands its events to the user's callbacks: a round to
    `after_report` (and `after_checkpoint` where it committed one), a failure to
    `after_failure` (and `after_exception` where a rank failed), the end to `after_run_end`."""

    def __init__(
        self,
        callbacks: Sequence[UserCallback],
        context: TrainRunContext,
        storage: Storage,
        state: RunState,
        since: datetime | None = None,
    ):
        self.context, self.storage, self.state = context, storage, state
        self.threads = [CallbackThread(c, knobs.CALLBACK_QUEUED_REPORTS) for c in callbacks]
        # Failures recorded when this driver took the run (the previous driver's crash): told
        # now, as the controller never saw them.
        for failure in state.failures:
            if since is not None and failure.time >= since:
                self.on_failure(failure)

    @classmethod
    def of(
        cls,
        callbacks: Sequence[UserCallback],
        plan: RunPlan,
        scaling: ScalingConfig,
        since: datetime | None = None,
    ) -> UserCallbacks:
        """The callbacks of the run `plan` prepared; `since`: when this driver started, before
        it read the run (failures recorded since then are told at once)."""
        name = plan.run_config.name or ""
        context = TrainRunContext(
            run_config=plan.run_config,
            train_loop_config=plan.train_loop_config,
            scaling_config=scaling,
            path=plan.storage.uri(name),
            driver_run=plan.state.driver_runs,
        )
        return cls(callbacks, context, plan.storage, plan.state, since)

    def __enter__(self) -> UserCallbacks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_round_done(
        self, index: int, rank_metrics: list[dict[str, Any]], entry: CheckpointEntry | None
    ) -> None:
        checkpoint = self._checkpoint(entry) if entry is not None else None
        if entry is not None and checkpoint is not None:
            self._put(
                "after_checkpoint",
                checkpoint=checkpoint,
                report_index=entry.report_index,
                metrics=entry.metrics,
            )
        for thread in self.threads:
            kwargs = {
                "run_context": self.context,
                "metrics": rank_metrics,
                "checkpoint": checkpoint,
            }
            if thread.takes_index:
                kwargs["report_index"] = index
            thread.put("after_report", kwargs, droppable=True)

    def on_failure(self, failure: FailureRecord) -> None:
        if failure.rank is not None:
            error = RankError(
                failure.error, failure.traceback, failure.rank, failure.step, failure.kind
            )
            self._put("after_exception", worker_exceptions={failure.rank: error})
        budget = self.context.run_config.failure_config.max_failures
        left = None if budget == -1 else retries_left(self.state, budget)
        self._put("after_failure", failure=failure, failures_left=left)

    def on_run_end(self, state: RunState) -> None:
        self._put("after_run_end", status=state.status, error=state.error)

    def close(self, timeout_s: float | None = None) -> None:
        """Deliver what is queued, up to `timeout_s` (`knobs.CALLBACK_DRAIN_S`) in all; say
        what was not delivered, dropped, or raised."""
        wait = knobs.CALLBACK_DRAIN_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        for thread in self.threads:
            left = thread.close(deadline)
            if left:
                logger.warning(
                    "ft-train: callback %s did not take its last %d events within %.0f s of "
                    "the run's end; they are dropped",
                    thread.name,
                    left,
                    wait,
                )
            if thread.dropped:
                logger.warning(
                    "ft-train: callback %s missed %d reports (it was slower than the run)",
                    thread.name,
                    thread.dropped,
                )
            for hook, n in thread.errors.items():
                if n > 1:
                    logger.warning("ft-train: callback %s.%s raised %d times", thread.name, hook, n)

    def _put(self, hook: str, **kwargs: Any) -> None:
        for thread in self.threads:
            thread.put(hook, {"run_context": self.context, **kwargs})

    def _checkpoint(self, entry: CheckpointEntry) -> Checkpoint:
        return Checkpoint(
            self.storage.uri(f"{self.context.name}/{entry.dir_name}"), self.storage.options
        )


def _accepts(method: Any, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: Ray's signature, as documented
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
