"""Deterministic fault injection at (rank, step), for tests, the demo and chaos runs.

A fault is a dict in the training function's config, e.g.
    {"rank": 1, "step": 7, "kind": "raise", "marker": "/tmp/x/fault-1"}
Faults: "raise" (an exception), "kill" (SIGKILL of the rank's own process), "exit"
(`os._exit(3)`), "freeze" (SIGSTOP of it: every thread stops, its Dask worker's too, as on a
machine that hangs), "hang" (block until the process is killed). A fault does nothing first
that a real one would not: no report is handed over, nothing is flushed.

Gates are not faults: they hold the rank at a point where the test acts on the cluster, and first
hand the rank's queued reports over, so that the driver has them when the test acts (a test's
synchronisation, as a barrier would be). "wait" at a point where the test kills a driver or a
node, "until_preempted" (block until this rank's worker is told to leave: a point at which to
send it SIGTERM), "until_file" (block until the file `path` exists: a point at which a test
changes the cluster).

With a `marker` path a fault fires once: the marker is created atomically before it acts, so a
rerun or a restart passes it by.

Faults may also come from outside the run's config: `FAULTS_ENV`, a JSON list in the
environment of the ranks (`from_environment()`). `ft-train demo` injects its crash so: a fault
in `train_loop_config` would be part of the run's stored config (its fingerprint), and the demo
would then be another run than the demo deployment's, which trains the same parameters without
it. A local cluster's ranks inherit the driver's environment.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterable
from typing import Any

from ..errors import SessionError


class InjectedFault(RuntimeError):
    """The exception a "raise" fault throws."""


# Faults for the ranks that are not part of the run's config: a JSON list of fault dicts.
FAULTS_ENV = "FT_TRAIN_INJECT_FAULTS"


def from_environment() -> list[dict[str, Any]]:
    """The faults in `FAULTS_ENV` (none where it is unset). Read by a training function once, at
    its start, as the edge where a user's script would read its own settings."""
    text = os.environ.get(FAULTS_ENV)
    if not text:
        return []
    faults = json.loads(text)
    if not isinstance(faults, list):
        raise ValueError(f"{FAULTS_ENV} must be a JSON list of faults, not {text!r}")
    return faults


# The kinds that hold the rank at a point where a test acts (kills its node, its driver, sends
# SIGTERM, changes the cluster) once the marker exists.
GATES = ("wait", "until_file", "until_preempted")


def _hand_over_reports() -> None:
    """Before a gate: hand the rank's queued reports to the driver (they go in batches,
    `rank.DaskSender`), so that when the test acts the driver has every report the rank made."""
    from ..worker import session

    try:
        send = session.current_session().send
    except SessionError:  # not inside a rank: nothing queued
        return
    flush = getattr(send, "flush", None)
    if flush is not None:
        flush()


def maybe_inject(faults: Iterable[dict[str, Any]] | None, rank: int, step: int) -> None:
    for fault in faults or ():
        if fault["rank"] != rank or fault["step"] != step:
            continue
        kind = fault.get("kind", "raise")
        if kind in GATES:
            _hand_over_reports()
        marker = fault.get("marker")
        if marker is not None:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue  # fired before
        if kind == "raise":
            raise InjectedFault(f"injected fault on rank {rank} at step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "exit":
            os._exit(3)
        if kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued (SIGCONT): the rank goes on
        if kind in ("wait", "hang"):
            threading.Event().wait()  # until this process is killed
        if kind == "until_file":  # until the test creates fault["path"]
            while not os.path.exists(fault["path"]):
                threading.Event().wait(0.01)
            return
        if kind == "until_preempted":
            from ..worker.preemption import local_deadline

            while local_deadline() is None:  # until this worker is told to leave (SIGTERM)
                threading.Event().wait(0.01)
            return
        raise ValueError(f"unknown fault kind {kind!r}")
