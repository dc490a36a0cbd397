"""What runs on a Dask worker: one rank of one attempt.

`run_rank` joins the process group (a fresh TCP rendezvous per attempt), installs the session,
calls the user's training function and turns any exception into a `RankFailure` made of plain
strings, so it crosses process boundaries whatever the user raised.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from .. import knobs
from ..compat import torch_distributed
from ..errors import (
    CheckpointDamagedError,
    ConfigError,
    RankFailure,
    SessionError,
    TrainLoopImportError,
)
from ..policy.attribution import lost_a_peer
from ..protocol import Message, RankSpec, Report, Started
from . import session as _session
from .devices import host_devices, pick_device, torchrun_environ
from .journal import Journal, run_key
from .preemption import GroupStop
from .session import Session

logger = logging.getLogger("ft_train")


def load_train_loop(train_loop: str | Callable) -> Callable:
    """Resolve 'package.module:function' and check that it can be called as `fn(config)` or
    `fn()`. Raises TrainLoopImportError (never retried): the driver calls this before any rank
    starts, so that no rank fails on what every rank would fail on."""
    fn = train_loop if callable(train_loop) else _import_train_loop(train_loop)
    _check_signature(train_loop, fn)
    return fn


def _import_train_loop(train_loop: Any) -> Callable:
    if not isinstance(train_loop, str) or ":" not in train_loop:
        raise TrainLoopImportError(
            f"train_loop {train_loop!r} must be an import path 'package.module:function' (or, "
            "in a Python call, the function itself)"
        )
    module_name, _, attr = train_loop.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise TrainLoopImportError(
            f"train_loop {train_loop!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
            "check the path and that the package is installed where the ranks run"
        ) from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if fn is None:
        raise TrainLoopImportError(
            f"train_loop {train_loop!r}: module {module_name!r} has no {attr!r}; check the name "
            "after the ':'"
        )
    if not callable(fn):
        raise TrainLoopImportError(
            f"train_loop {train_loop!r}: {attr!r} is a {type(fn).__name__}, not a function; "
            "give the training function's name after the ':'"
        )
    return fn


def _check_signature(train_loop: Any, fn: Callable) -> None:
    """A rank calls `fn(config)` if it takes a parameter, else `fn()` (`call_train_loop`)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call itself will tell
    try:
        sig.bind({}) if sig.parameters else sig.bind()
    except TypeError as e:
        raise TrainLoopImportError(
            f"train_loop {train_loop!r} cannot be called as fn(train_loop_config): its signature "
            f"is {sig} ({e}); define it as `def train_fn(config):` (or with no parameters), and "
            "give any other parameter a default"
        ) from None


def call_train_loop(fn: Callable, config: dict[str, Any]) -> Any:
    try:
        takes_config = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes_config = True
    return fn(config) if takes_config else fn()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class DaskSender:
    """Reports travel as Dask events to the driver's client, batched.

    The rank's thread only appends a message to a queue; the worker's event loop hands what is
    queued to `Worker.log_event`, as one event, every `interval_s`: a call from the rank's
    thread would wake the event loop, and each event costs the scheduler and the driver their
    own handling (bench/README.md has the figures). The driver learns of metrics up to
    `interval_s` later; a checkpoint's message goes at once, so that its round commits soon.
    What dies queued with a killed rank is not lost: the rank's journal has what a commit needs
    (`ft_train.worker.journal`). `flush()` hands over what is queued now (a test's gate uses it);
    `close()` hands over what is left and returns once the event loop has taken it, before the
    rank's task returns."""

    def __init__(self, topic: str, interval_s: float = knobs.REPORT_BATCH_S):
        from distributed import get_worker
        from tornado.ioloop import PeriodicCallback

        self.worker, self.topic = get_worker(), topic
        self.queue: collections.deque[dict] = collections.deque()
        self._timer = PeriodicCallback(self._flush, interval_s * 1000)
        self.worker.loop.add_callback(self._timer.start)

    def __call__(self, msg: Message) -> None:
        self.queue.append(msg.wire())  # thread-safe; also called by the upload thread
        if isinstance(msg, Report) and msg.dir_name is not None:
            self.worker.loop.add_callback(self._flush)

    def _flush(self) -> None:  # on the worker's event loop
        batch = []
        while self.queue:
            batch.append(self.queue.popleft())
        if batch:
            self.worker.log_event(self.topic, batch)

    def flush(self, timeout_s: float = 10.0, last: bool = False) -> None:
        """Hand what is queued to the worker's event loop now; returns once it has taken it."""
        handed_over = threading.Event()

        def flush_now() -> None:
            if last:
                self._timer.stop()
            self._flush()
            handed_over.set()

        self.worker.loop.add_callback(flush_now)
        if not handed_over.wait(timeout_s):  # the event loop is blocked: nothing more to do
            logger.warning("ft-train: %d reports may not reach the driver", len(self.queue))

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s, last=True)


def _init_process_group(spec: RankSpec) -> None:
    import torch
    import torch.distributed as dist

    torch_distributed.import_dynamo()  # the first DDP imports it: not in the watchdog's time
    if spec.rank != 0:
        _await_store(spec.master_addr, spec.master_port, spec.collective_timeout_s)
    dist.init_process_group(
        spec.backend,
        init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    if spec.use_gpu:  # before the first collective: NCCL takes the current device then
        store = torch_distributed.default_store()
        seen = host_devices(store, spec.node_rank, spec.local_rank, spec.local_world_size)
        torch.cuda.set_device(pick_device(spec.local_rank, seen, socket.gethostname()))


def _await_store(host: str, port: int, timeout_s: float) -> None:
    """Until rank 0's rendezvous store accepts connections (or `timeout_s`: then torch's own
    connect reports what is wrong). torch's store client waits 0.3-0.5 s before it tries again
    after a refused connection, which every restart paid where a rank started even 20 ms before
    rank 0; a probe every 5 ms does not. The store does not count a probe as a rank."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=knobs.ANSWER_TIMEOUT_S).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)  # polling a port that is about to open, bounded by the deadline


@contextlib.contextmanager
def _torchrun_environ(spec: RankSpec) -> Iterator[None]:
    """torchrun's variables in this process while the training function runs (one rank per
    worker process), then the worker's own again; on CPU ranks accelerate's ACCELERATE_USE_CPU."""
    env = torchrun_environ(
        spec.rank,
        spec.local_rank,
        spec.world_size,
        spec.local_world_size,
        spec.node_rank,
        spec.master_addr,
        spec.master_port,
    )
    if not spec.use_gpu:
        # What `accelerate launch --cpu` sets: accelerate (under the Transformers Trainer) takes
        # torchrun's variables for a CPU group only with it, and would else train each rank
        # alone on a machine without a GPU (with one, on the GPU the rank was not given).
        env["ACCELERATE_USE_CPU"] = "true"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _damaged(error: BaseException) -> str | None:
    """The path of the damaged checkpoint behind `error`, if a CheckpointDamagedError is in its
    chain (a training function may wrap it)."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, CheckpointDamagedError):
            return link.path
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _pickled(value: Any) -> bytes:
    """`value` pickled here, for the driver (`Controller.return_value`): pickled by Dask with the
    task's result instead, a value that cannot be pickled would lose the result, and the driver
    would take the rank for dead. SessionError (never retried): a restart would return the same."""
    from distributed.protocol import pickle

    try:
        return pickle.dumps(value)
    except Exception as e:
        raise SessionError(
            f"the training function returned a {type(value).__name__} on rank 0, which cannot be "
            f"pickled ({type(e).__name__}: {e}); return plain data (numbers, strings, lists, "
            "dicts, tensors), or save the object in a checkpoint and return nothing"
        ) from None


def run_rank(spec: RankSpec, send: Callable[[Message], None] | None = None) -> dict[str, Any]:
    """The Dask task of one rank. Returns a summary; raises RankFailure if the function raised."""
    import torch.distributed as dist

    sender = DaskSender(spec.topic) if send is None else None
    journal = Journal(run_key(spec.storage.uri(spec.name)), spec.attempt_id, spec.rank)
    session = Session(spec, send or sender, journal)  # type: ignore[arg-type]  # one of them is set
    _session.install(session)
    try:
        fn = load_train_loop(spec.train_loop)
        _init_process_group(spec)
        session.control = torch_distributed.control_group()
        journal.joined(spec.start_report_index)  # the driver counts it as started
        session.send(Started(spec.rank))  # the hang watchdog starts here
        with _torchrun_environ(spec):
            returned = call_train_loop(fn, spec.config)
        session.finish()  # waits for the pending uploads
        summary: dict[str, Any] = {"rank": spec.rank, "reports": session.report_index}
        if spec.rank == 0 and returned is not None:  # Ray's `Result.return_value`: rank 0's
            summary["return_value"] = _pickled(returned)
        return summary
    except GroupStop:  # the driver stopped the group (to resize it); this process stays
        session.stopped()
        return {"rank": spec.rank, "reports": session.report_index, "stopped": True}
    except BaseException as e:  # every failure of the user function becomes a RankFailure
        tb = traceback.format_exc(limit=-20)
        error = f"{type(e).__name__}: {e}"
        # a broken contract (ConfigError, SessionError): no retry can fix it
        fatal = isinstance(e, (ConfigError, SessionError))
        if not fatal and lost_a_peer(error):  # a peer failed first: save just in time, if opted in
            session.snapshots.jit(session.report_index)
        # the rounds whose uploads are pending were reported: let them finish (journaled)
        session.stopped(knobs.FAIL_FLUSH_S)
        raise RankFailure(spec.rank, session.report_index, error, tb, fatal, _damaged(e)) from None
    finally:
        session.close()  # drops uploads still pending (none after a clean finish)
        session.control = None  # released before the default group, whose device it shares
        _session.install(None)
        journal.close()
        if sender is not None:
            sender.close()  # the last reports are on their way before the task's result
        if dist.is_initialized():
            dist.destroy_process_group()
