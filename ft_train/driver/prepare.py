"""Driver-side steps that the Prefect tasks wrap: prepare (validate + rehydrate), and the
controller's construction. Everything here runs in the flow process, before or around workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..config import RunConfig, ScalingConfig, name_of
from ..controller import Callback, Controller, GroupPlan
from ..controller.history import HistoryRecorder
from ..errors import ConfigError, RunLockedError, StorageError, TrainingFailedError
from ..policy.failure import driver_restarts_spent
from ..result import TrainResult
from ..storage.checkpoint_manager import CheckpointManager
from ..storage.fs import Storage
from ..storage.metric_history import MetricHistory, load_history
from ..storage.run_state import STATE_FILE, FailureKind, FailureRecord, RunState, RunStore
from ..worker import journal
from ..worker.rank import load_train_loop
from . import resume
from .lease import LEASE_FILE, RunLease
from .worker_group import DaskCluster

logger = logging.getLogger("ft_train")


@dataclass
class RunPlan:
    train_loop: str | Callable
    train_loop_config: dict[str, Any]
    scaling: ScalingConfig
    run_config: RunConfig
    storage: Storage
    store: RunStore
    state: RunState
    lease: RunLease
    # The run's metric history, read by `make_controller` (one read: a finished run needs none).
    history: MetricHistory = field(default_factory=MetricHistory)

    @property
    def finished(self) -> bool:
        return self.state.status == "finished"

    def release(self) -> None:
        """The driver is done with the run (its ranks are gone): remove the checkpoint
        directories it left uncommitted, so that the next start need not list the run (a driver
        that finished swept already), then let the next driver start at once."""
        try:
            if not self.finished:
                with contextlib.suppress(RunLockedError):  # the run is another driver's now
                    _sweep_orphans(
                        self.storage, self.store, self.state, self.run_config, logger.info
                    )
        finally:  # also on a second Ctrl+C midway
            self.lease.release()

    def result(self) -> TrainResult:
        return TrainResult.from_state(self.storage, self.state, self.run_config.checkpoint_config)


def prepare_run(
    train_loop: str | Callable,
    train_loop_config: dict[str, Any] | None,
    scaling: ScalingConfig,
    run_config: RunConfig,
    log: Callable[[str], None] = logger.info,
    holder: str = "",
    holder_id: str = "",
    storage: Storage | None = None,
) -> RunPlan:
    """Validate the input, take the run's lease (`holder` says who for, `holder_id` its id: a
    flow run), find (or create) the run state and remove the checkpoint directories a crashed
    driver left uncommitted. Fails before any worker starts; a run that another driver is
    training raises RunLockedError. The caller calls `release()` on the plan when done.
    `storage`: the run's storage, opened from `run_config` by default (a test passes one that
    injects faults)."""
    load_train_loop(train_loop)
    config = loop_config(train_loop_config)
    if storage is None:
        storage = Storage(run_config.storage_path, run_config.storage_options)
    store = RunStore(storage, name_of(run_config))
    new = resume.wanted(train_loop, config, scaling, run_config.checkpoint_config)
    # Read once before the lease is taken: stored state that cannot be resumed (corrupt, from a
    # newer ft-train, a directory that is not a run's), storage that cannot be used, and a
    # refusal by run_config.resume all fail here with nothing written, not even the lease. Asked
    # again under the lease, where it counts.
    resume.check(
        run_config,
        peek(run_config, storage, store),
        new,
        storage.uri(name_of(run_config)),
        lambda msg: None,
    )
    lease = RunLease(storage, name_of(run_config), holder, holder_id, log=log)
    try:
        lease.acquire()
        store.lease = lease
        plan = _rehydrate(train_loop, config, scaling, run_config, new, storage, store, lease, log)
    except BaseException as e:
        lease.release()
        if isinstance(
            e, (StorageError, RunLockedError, ConfigError, TrainingFailedError)
        ) or not isinstance(e, Exception):
            raise
        raise storage_error(run_config, "use", e) from None
    if plan.finished:
        plan.release()  # nothing to write
    return plan


def loop_config(train_loop_config: Any) -> dict[str, Any]:
    """`train_loop_config` as the ranks get it and the run state records it: a dict of JSON
    values. NaN and infinity are refused: JSON has no such numbers, so the stored config would
    not read back equal, and a resumed run would see a changed config every time."""
    if train_loop_config is None:
        return {}
    if not isinstance(train_loop_config, dict):
        raise ConfigError(
            f"train_loop_config must be a dict of JSON values, not a "
            f"{type(train_loop_config).__name__}: e.g. {{'epochs': 10}}"
        )
    try:
        json.dumps(train_loop_config, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"train_loop_config must be JSON-serialisable ({e}); give numbers, strings, lists "
            "and dicts (NaN or infinity as a string, e.g. 'nan')"
        ) from None
    return dict(train_loop_config)


def peek(run_config: RunConfig, storage: Storage, store: RunStore) -> RunState | None:
    """The stored run state, read without the lease; for a new run, a check that a run can be
    created there. A local path is checked first (no I/O to speak of), so that a file in the
    way is named as such; a bucket only for a new run (one request)."""
    try:
        if storage.is_local:
            _check_usable(run_config, storage)
        state = store.load()
        if state is None:
            if not storage.is_local:
                _check_usable(run_config, storage)
            _check_new_run_dir(run_config, storage)
        return state
    except StorageError:
        raise
    except Exception as e:
        raise storage_error(run_config, "read", e) from None


def _check_usable(run_config: RunConfig, storage: Storage) -> None:
    problem = storage.unusable()
    if problem is not None:
        raise StorageError(f"run_config.storage_path {run_config.storage_path!r}: {problem}")


# What a run directory may hold before its run state is first written: the lease of a driver
# that stopped before it wrote the state, and the temporary files of atomic writes.
_BEFORE_STATE = (LEASE_FILE, f"{LEASE_FILE}.lock")
_TEMP = re.compile(r"\.tmp-[0-9a-f]{8}$")


def _check_new_run_dir(run_config: RunConfig, storage: Storage) -> None:
    """A new run: its directory must hold nothing that ft-train did not write (a name that
    collides with other data, a run whose state was deleted): a run started there would mix
    with it, and its orphan collection could delete checkpoints the lost state referenced."""
    foreign = [
        n
        for n in storage.list_dir(name_of(run_config))
        if n not in _BEFORE_STATE and not _TEMP.search(n)
    ]
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        raise StorageError(
            f"{storage.uri(name_of(run_config))} holds files but no {STATE_FILE} ({shown}): it is not "
            "an ft-train run, or its run state was deleted. Use another run_config.name (or "
            "run_config.storage_path), or move those files away"
        )


def storage_error(run_config: RunConfig, doing: str, e: Exception) -> StorageError:
    """A StorageError for an error of the storage itself, with the setting that likely fixes it."""
    if isinstance(e, PermissionError) and "://" not in run_config.storage_path:
        hint = "permission denied: give a run_config.storage_path you can write to"
    elif isinstance(e, PermissionError):
        hint = (
            "permission denied: check the credentials in run_config.storage_options (key, "
            "secret) or the environment's, and that they may read and write there"
        )
    elif isinstance(e, (NotADirectoryError, FileExistsError)):
        hint = "a part of the path is a file: give a directory in run_config.storage_path"
    else:
        hint = "check run_config.storage_path and run_config.storage_options"
    return StorageError(
        f"cannot {doing} the run under {run_config.storage_path} ({type(e).__name__}: {e}); {hint}"
    )


def _rehydrate(
    train_loop: str | Callable,
    config: dict[str, Any],
    scaling: ScalingConfig,
    run_config: RunConfig,
    new: resume.Wanted,
    storage: Storage,
    store: RunStore,
    lease: RunLease,
    log: Callable[[str], None],
) -> RunPlan:
    """Load the run state (or create it), under the lease, record this driver's start, and sweep
    the previous drivers' uncommitted checkpoint directories."""
    state = store.load()
    where = storage.uri(name_of(run_config))
    trains_on = resume.check(run_config, state, new, where, log)  # a finished run, extended
    # A driver that ended released the lease, and swept its leftovers; one that was killed
    # could do neither. A new run has nothing to sweep (nor a run with no state file).
    crashed = lease.previous is None or not lease.previous.released
    sweep = state is not None and crashed
    spent = None
    if state is None:
        state = RunState(name=run_config.name)
        log(f"new run {run_config.name!r} at {where}")
    elif state.status == "finished" and not trains_on:
        log(f"run {run_config.name!r} at {where} already finished; nothing to train")
        return RunPlan(train_loop, config, scaling, run_config, storage, store, state, lease)
    else:
        spent = _resume(state, where, log, crashed, run_config)
    state.config, state.config_fingerprint = new  # what the run trains with from now on
    state.driver_runs += 1
    try:
        store.save(state)
    except RunLockedError:
        raise
    except Exception as e:
        raise storage_error(run_config, "write", e) from None
    if spent is not None:
        raise spent  # recorded: Failed, which no automation reruns; a rerun by hand counts afresh
    if sweep:
        _sweep_orphans(storage, store, state, run_config, log)
    return RunPlan(train_loop, config, scaling, run_config, storage, store, state, lease)


def _sweep_orphans(
    storage: Storage, store: RunStore, state: RunState, run_config: RunConfig, log: Callable
) -> None:
    """Remove the checkpoint directories the run state does not reference: uploads of rounds
    that a driver never committed. A driver that finishes training sweeps its own in
    `Controller._finish` (reading the sealed index too), one that stops otherwise in
    `RunPlan.release`, and the next start sweeps after a driver that was killed.

    Crash ordering: this runs under the lease, when no rank of this driver exists (before the
    first, or after the last), so a directory unreferenced now belongs to an attempt that can
    never commit; a crash midway leaves the rest for the next start.
    Cost: one listing of the run's directory, no read (invariant 5): an orphan older than the
    head's oldest entry of a run with a sealed index is left to `_finish`'s full sweep."""
    manager = CheckpointManager(storage, store, run_config.checkpoint_config)
    try:
        removed = manager.collect_orphans(state, read_index=False)
    except RunLockedError:
        raise
    except Exception as e:  # leftovers cost space, not correctness: train, and sweep next time
        log(
            f"could not remove the uncommitted checkpoint directories of run {state.name!r} "
            f"({type(e).__name__}: {e}); a later sweep removes them"
        )
        return
    if removed:
        log(f"removed {len(removed)} uncommitted checkpoint directories: {', '.join(removed)}")


def _resume(
    state: RunState, where: str, log: Callable[[str], None], crashed: bool, run_config: RunConfig
) -> TrainingFailedError | None:
    """Record the previous driver's end, and return the error that fails the run if its crash
    spent the driver-restart budget (the run state then says so)."""
    if state.status == "running" and crashed:
        # The previous driver never recorded an end: it was killed. Not charged to max_failures.
        reports, last_report_at = _progress_at_crash(state, where)
        state.failures.append(
            FailureRecord(
                kind=FailureKind.DRIVER_CRASH,
                error="the previous driver stopped without recording an end",
                step=reports,
                attempt=len(state.attempts) - 1,
                charged=False,
                reports=reports,
                last_report_at=last_report_at,
            )
        )
    elif state.status in ("failed", "finished"):  # finished: trains on with a changed config
        state.budget_start = len(state.failures)  # a new flow run gets a fresh failure budget
    state.status, state.error, state.error_type = "running", None, None
    spent = driver_restarts_spent(state, run_config.failure_config)
    if spent is not None:
        state.status, state.error = "failed", str(spent)
        return spent
    frm = f"checkpoint {state.latest} (report {state.report_index})" if state.latest else "scratch"
    log(f"resuming run {state.name!r} at {where} from {frm}")
    return None


def _progress_at_crash(state: RunState, where: str) -> tuple[int, datetime]:
    """How far the crashed driver's run had got, and when. Its ranks' journals say it exactly
    where they are on this machine (a local cluster's shared memory outlives the kill:
    `ft_train.worker.journal.progress`); else the run state's last save is all that is known
    (on a cluster elsewhere, a few reports too few)."""
    known = (state.reports, state.updated_at)
    if not state.attempts:
        return known
    last = state.attempts[-1]
    found = journal.progress(journal.run_key(where), last.attempt_id, last.world_size)
    if found is None or found.index < state.reports:
        return known
    return found.index, datetime.fromtimestamp(found.at, UTC)


def interrupt_or(error: BaseException) -> BaseException:
    """The interrupt in `error`'s chain (a BaseException that is not an Exception: Ctrl+C,
    SystemExit, Prefect's TerminationSignal), else `error`. Prefect's task engine puts its own
    error in place of a Ctrl+C that lands while it creates a task run (its crash handler raises
    "ValueError: Task run is not set"): that is still the user's Ctrl+C."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if not isinstance(link, Exception):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return error


def make_controller(
    plan: RunPlan,
    client,
    log: Callable[[str], None] = logger.info,
    warm: Sequence[str] = (),
    callbacks: Sequence[Callback] = (),
) -> Controller:
    """The run's controller on the Dask cluster of `client`; `warm`: modules every worker
    imports beyond torch, as it joins (`ClusterConfig.preload`); `callbacks`: who is told of
    attempts, checkpoints, failures and the run's end."""
    group_plan = GroupPlan(
        train_loop=plan.train_loop,
        config=plan.train_loop_config,
        name=name_of(plan.run_config),
        storage=plan.storage,
        min_workers=plan.scaling.min_workers,
        max_workers=plan.scaling.max_workers,
        elastic_wait_s=plan.scaling.elastic_wait_s,
        use_gpu=plan.scaling.use_gpu,
        start_timeout_s=plan.scaling.worker_start_timeout_s,
        collective_timeout_s=plan.run_config.failure_config.collective_timeout_s,
        agreement_interval_s=plan.run_config.failure_config.agreement_interval_s,
        warm=tuple(warm),
        snapshot_every=plan.run_config.checkpoint_config.snapshot_every,
    )
    manager = CheckpointManager(plan.storage, plan.store, plan.run_config.checkpoint_config)
    try:
        plan.history = load_history(plan.storage, name_of(plan.run_config))
    except StorageError as e:  # the history only informs: train, and start it afresh
        log(f"{e}; the run's metric history starts afresh")
    recorder = HistoryRecorder(plan.store, plan.history)  # first: the others see it current
    controller = Controller(
        DaskCluster(client),
        group_plan,
        plan.state,
        plan.store,
        manager,
        plan.run_config.failure_config,
        log,
        [recorder, *callbacks],
    )
    plan.lease.on_lost = controller.lease_lost  # stop training at once, not at the next write
    return controller
