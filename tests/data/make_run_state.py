"""Writes tests/data/run_state_f5c7211/: a run's directory (run_state.json and the manifests of
its checkpoints) as ft-train wrote it at commit f5c7211 (main on 2026-12-07; it was run at
333a016, which changes no code under ft_train/), with failures of every kind, for the test that
a run state written then still resumes (tests/unit/test_failure_kinds.py). Driven through the
real controller, run store and checkpoint manager on a fake cluster (tests/fake_cluster.py);
the driver crash recorded as `ft_train.driver.prepare` does.

Run once at that commit (the controller's private names it uses have moved since):
    PYTHONPATH=. python tests/data/make_run_state.py tests/data/run_state_f5c7211
"""

import shutil
import sys
import tempfile
import time

import ft_train
from ft_train.controller import Controller, GroupPlan, Restarting
from ft_train.errors import AttemptFailed
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import FailureRecord, RunState, RunStore
from tests.fake_cluster import FakeCluster


def controller(storage, store, state, cluster):
    plan = GroupPlan(
        train_loop="x:y",
        config={},
        name="run",
        storage=storage,
        min_workers=2,
        max_workers=2,
        use_gpu=False,
        start_timeout_s=1.0,
        collective_timeout_s=1800.0,
        agreement_interval_s=0.0,
        elastic_wait_s=0.0,
    )
    cfg = ft_train.CheckpointConfig(num_to_keep=2)
    failure = ft_train.FailureConfig(max_failures=-1, hang_timeout_s=0.05)
    return Controller(
        cluster,
        plan,
        state,
        store,
        CheckpointManager(storage, store, cfg),
        failure,
        log=lambda m: None,
    )


def started(ctl):
    ctl._set_state(ctl.step())
    return ctl.cluster.group


def failed(ctl):
    try:
        ctl.run_segment()
    except AttemptFailed:
        return
    raise AssertionError("no failure")


def main(out):
    root = tempfile.mkdtemp()
    storage = Storage(root)
    store = RunStore(storage, "run")
    cluster = FakeCluster(40)
    ctl = controller(storage, store, RunState(name="run"), cluster)
    g = started(ctl).joined().report(1, checkpoint=True, loss=0.9)
    ctl.run_segment()
    g.raised(1, "ValueError: boom", step=1)
    failed(ctl)  # exception
    g = started(ctl).joined().report(2, checkpoint=True, loss=0.8)
    ctl.run_segment()
    cluster.lost_kinds[g.addresses[0]] = "process_death"
    g.lost(0)
    failed(ctl)  # process_death
    g = started(ctl).joined()
    g.ended(1, cancelled=True)
    failed(ctl)  # node_loss
    g = started(ctl).joined().report(3, checkpoint=True, loss=0.7)
    ctl.run_segment()
    g.report(4, ranks=[0])
    failed(ctl)  # hang (rank 1, the watchdog)
    g = started(ctl).joined().notice(0, deadline=time.time() - 1)
    while not isinstance(ctl.current, Restarting):  # preemption, uncharged
        ctl._set_state(ctl.step())
    g = started(ctl).joined()
    # the driver is killed here (its state says running); the next one records a driver crash
    state = store.load()
    assert state.status == "running"
    state.failures.append(
        FailureRecord(
            kind="driver_crash",
            error="the previous driver stopped without recording an end",
            step=state.report_index,
            attempt=len(state.attempts) - 1,
            charged=False,
        )
    )
    store.save(state)
    ctl = controller(storage, store, state, cluster)
    started(ctl).joined().report(4, checkpoint=True, loss=0.6)
    ctl.run_segment()
    ctl.abort(KeyboardInterrupt())  # driver_interrupt
    kinds = [f.kind for f in store.load().failures]
    print(kinds)
    shutil.copytree(f"{root}/run", out)


if __name__ == "__main__":
    main(sys.argv[1])
