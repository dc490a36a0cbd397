"""Driver-side steps that the Prefect tasks wrap: prepare (validate + rehydrate), and the
controller's construction. Everything here runs in the flow process, before or around workers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from . import resume
from .checkpoint_manager import CheckpointManager
from .config import RunConfig, ScalingConfig
from .cluster import DaskCluster
from .controller import Callback, Controller, GroupPlan
from .errors import ConfigError, RunLockedError, StorageError
from .lease import RunLease
from .rank import load_train_loop
from .result import TrainResult
from .run_state import FailureRecord, RunState, RunStore
from .storage import Storage

logger = logging.getLogger("ft_train")


@dataclass
class RunPlan:
    train_loop: Union[str, Callable]
    train_loop_config: dict[str, Any]
    scaling: ScalingConfig
    run_config: RunConfig
    storage: Storage
    store: RunStore
    state: RunState
    lease: RunLease

    @property
    def finished(self) -> bool:
        return self.state.status == "finished"

    def release(self) -> None:
        """The driver is done with the run: the next one may start at once."""
        self.lease.release()

    def result(self) -> TrainResult:
        return TrainResult.from_state(self.storage, self.state, self.run_config.checkpoint_config)


def prepare_run(
    train_loop: Union[str, Callable],
    train_loop_config: Optional[dict[str, Any]],
    scaling: ScalingConfig,
    run_config: RunConfig,
    log: Callable[[str], None] = logger.info,
    holder: str = "",
    holder_id: str = "",
    storage: Optional[Storage] = None,
) -> RunPlan:
    """Validate the input, take the run's lease (`holder` says who for, `holder_id` its id: a
    flow run), find (or create) the run state and remove the checkpoint directories a crashed
    driver left uncommitted. Fails before any worker starts; a run that another driver is
    training raises RunLockedError. The caller calls `release()` on the plan when done.
    `storage`: the run's storage, opened from `run_config` by default (a test passes one that
    injects faults)."""
    load_train_loop(train_loop)
    config = dict(train_loop_config or {})
    try:
        json.dumps(config)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"train_loop_config must be JSON-serialisable: {e}") from None

    if storage is None:
        storage = Storage(run_config.storage_path, run_config.storage_options)
    store = RunStore(storage, run_config.name)
    new = resume.wanted(train_loop, config, scaling, run_config.checkpoint_config)
    if run_config.resume != "auto":  # asked again under the lease; here, a refusal writes nothing
        try:
            state = store.load()
        except StorageError:
            raise
        except Exception as e:
            raise _unreadable(run_config, e) from None
        resume.check(run_config, state, new, storage.uri(run_config.name), lambda msg: None)
    lease = RunLease(storage, run_config.name, holder, holder_id, log=log)
    try:
        lease.acquire()
        store.lease = lease
        plan = _rehydrate(train_loop, config, scaling, run_config, new, storage, store, lease, log)
    except BaseException as e:
        lease.release()
        if isinstance(e, (StorageError, RunLockedError, ConfigError)) or not isinstance(e, Exception):
            raise
        raise _unreadable(run_config, e) from None
    if plan.finished:
        plan.release()  # nothing to write
    return plan


def _unreadable(run_config: RunConfig, e: Exception) -> StorageError:
    return StorageError(
        f"cannot read run state under {run_config.storage_path} ({type(e).__name__}: {e}); "
        "check run_config.storage_path and run_config.storage_options"
    )


def _rehydrate(
    train_loop: Union[str, Callable],
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
    where = storage.uri(run_config.name)
    resume.check(run_config, state, new, where, log)
    resumed = state is not None  # a new run has nothing to sweep (nor a run with no state file)
    if state is None:
        state = RunState(name=run_config.name)
        log(f"new run {run_config.name!r} at {where}")
    elif state.status == "finished":
        log(f"run {run_config.name!r} at {where} already finished; nothing to train")
        return RunPlan(train_loop, config, scaling, run_config, storage, store, state, lease)
    else:
        # A driver that ended released the lease; one that was killed could not.
        crashed = lease.previous is None or not lease.previous.released
        _resume(state, where, log, crashed)
    state.config, state.config_fingerprint = new  # what the run trains with from now on
    state.driver_runs += 1
    try:
        store.save(state)
    except RunLockedError:
        raise
    except Exception as e:
        raise StorageError(
            f"cannot write to {where} ({type(e).__name__}: {e}); check run_config.storage_path "
            "and run_config.storage_options"
        ) from None
    if resumed:
        _sweep_orphans(storage, store, state, run_config, log)
    return RunPlan(train_loop, config, scaling, run_config, storage, store, state, lease)


def _sweep_orphans(
    storage: Storage, store: RunStore, state: RunState, run_config: RunConfig, log: Callable
) -> None:
    """Remove the checkpoint directories the run state does not reference: uploads of rounds
    that a killed (or failed) driver never committed. A driver that finishes training sweeps
    its own in `Controller._finish`; nothing else would remove these.

    Crash ordering: this runs under the lease, after this driver's start is saved and before
    any rank of this driver exists, so a directory unreferenced now belongs to an attempt that
    can never commit (its driver is gone); a crash midway leaves the rest for the next start.
    Cost: one listing of the run's directory, no read (invariant 5): an orphan older than the
    head's oldest entry of a run with a sealed index is left to `_finish`'s full sweep."""
    manager = CheckpointManager(storage, store, run_config.checkpoint_config)
    try:
        removed = manager.collect_orphans(state, read_index=False)
    except RunLockedError:
        raise
    except Exception as e:  # leftovers cost space, not correctness: train, and sweep next time
        log(f"could not remove the uncommitted checkpoint directories of run {state.name!r} "
            f"({type(e).__name__}: {e}); the next driver start tries again")
        return
    if removed:
        log(f"removed {len(removed)} uncommitted checkpoint directories left by a crash: "
            f"{', '.join(removed)}")


def _resume(state: RunState, where: str, log: Callable[[str], None], crashed: bool) -> None:
    if state.status == "running" and crashed:
        # The previous driver never recorded an end: it was killed. Not charged to max_failures.
        state.failures.append(
            FailureRecord(
                kind="driver_crash",
                error="the previous driver stopped without recording an end",
                step=state.report_index,
                attempt=len(state.attempts) - 1,
                charged=False,
            )
        )
    elif state.status == "failed":
        state.budget_start = len(state.failures)  # a new flow run gets a fresh failure budget
    state.status, state.error = "running", None
    frm = f"checkpoint {state.latest} (step {state.report_index})" if state.latest else "scratch"
    log(f"resuming run {state.name!r} at {where} from {frm}")


def interrupt_or(error: BaseException) -> BaseException:
    """The interrupt in `error`'s chain (a BaseException that is not an Exception: Ctrl+C,
    SystemExit, Prefect's TerminationSignal), else `error`. Prefect's task engine puts its own
    error in place of a Ctrl+C that lands while it creates a task run (its crash handler raises
    "ValueError: Task run is not set"): that is still the user's Ctrl+C."""
    seen, link = set(), error
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
        name=plan.run_config.name,
        storage=plan.storage,
        min_workers=plan.scaling.min_workers,
        max_workers=plan.scaling.max_workers,
        elastic_wait_s=plan.scaling.elastic_wait_s,
        use_gpu=plan.scaling.use_gpu,
        start_timeout_s=plan.scaling.worker_start_timeout_s,
        collective_timeout_s=plan.run_config.failure_config.collective_timeout_s,
        agreement_interval_s=plan.run_config.failure_config.agreement_interval_s,
        warm=tuple(warm),
    )
    manager = CheckpointManager(plan.storage, plan.store, plan.run_config.checkpoint_config)
    controller = Controller(
        DaskCluster(client), group_plan, plan.state, plan.store, manager,
        plan.run_config.failure_config, log, callbacks,
    )
    plan.lease.on_lost = controller.lease_lost  # stop training at once, not at the next write
    return controller
