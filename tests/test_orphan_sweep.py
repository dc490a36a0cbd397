"""Crash leftovers go at the next driver start, and nothing the run state references ever goes.

A checkpoint directory that no run state references is what a crash leaves: ranks that uploaded
a round their driver never committed, or a manifest written just before the driver died. A driver
sweeps its own as it ends (`Controller._finish`, `RunPlan.release`); a killed one cannot, so the
next `prepare_run` sweeps them once it holds the run's lease. Run against a local path and the
loopback S3 endpoint (the `storage` fixture).
"""

from __future__ import annotations

from pathlib import Path

from ft_train.config import CheckpointConfig, RunConfig, ScalingConfig
from ft_train.driver import prepare
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.run_state import RunStore
from tests.helpers import fresh, load_state, run_killed
from tests.write_path import (
    NOOP,
    commit_round,
    merged,
    rank_files,
    report_round,
    restore,
    stored_files,
    stored_names,
)

ATTEMPT_0, ATTEMPT_1 = "0a" * 16, "1b" * 16

# A driver process that commits rounds 1-3 (num_to_keep=2), then crashes in round 4 as a real
# run does: attempt 0's rank 0 uploads round 4 and the group fails (rank 1 never uploads); the
# retry, attempt 1, uploads round 4 on both ranks, the driver writes its manifest, and is
# SIGKILLed in place of the run-state write that would have committed it.
CRASHED_DRIVER = """
import json, os, signal, sys
from pathlib import Path
from ft_train.driver import prepare
from ft_train.config import CheckpointConfig, RunConfig, ScalingConfig
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.run_state import STATE_FILE
from ft_train.storage.fs import Storage
from tests.write_path import commit_round, rank_files, report_round

class DiesAtCommit(Storage):
    armed = False
    def write_atomic(self, path, data):
        if self.armed and path.endswith(STATE_FILE):
            os.kill(os.getpid(), signal.SIGKILL)
        super().write_atomic(path, data)

a = json.loads(sys.argv[1])
cfg = CheckpointConfig(num_to_keep=2)
run_config = RunConfig(name=a["name"], storage_path=a["path"], storage_options=a["options"],
                       checkpoint_config=cfg)
storage = DiesAtCommit(a["path"], a["options"])
plan = prepare.prepare_run(a["noop"], {}, ScalingConfig(), run_config, storage=storage)
manager = CheckpointManager(plan.storage, plan.store, cfg)
work = Path(a["work"])
for i in (1, 2, 3):
    msgs = report_round(storage, a["name"], i, rank_files(f"c{i}"), {"step": i}, 0, a["a0"], work)
    commit_round(manager, plan.state, msgs, i, 0)
report_round(storage, a["name"], 4, rank_files("lost")[:1], {}, 0, a["a0"], work)
msgs = report_round(storage, a["name"], 4, rank_files("c4"), {"step": 4}, 1, a["a1"], work)
storage.armed = True
commit_round(manager, plan.state, msgs, 4, 1)
print("not killed")
"""


def crash_a_driver(target, name: str, work: Path) -> None:
    args = dict(
        name=name,
        path=target.path,
        options=target.options,
        noop=NOOP,
        work=str(work),
        a0=ATTEMPT_0,
        a1=ATTEMPT_1,
    )
    work.mkdir()
    run_killed(CRASHED_DRIVER, args)


def start_driver(target, name: str, cfg: CheckpointConfig, logged: list[str]) -> prepare.RunPlan:
    run_config = RunConfig(
        name=name, storage_path=target.path, storage_options=target.options, checkpoint_config=cfg
    )
    return prepare.prepare_run(NOOP, {}, ScalingConfig(), run_config, log=logged.append)


def test_next_driver_start_removes_a_killed_drivers_uncommitted_checkpoints(storage, tmp_path):
    name = "killed"
    crash_a_driver(storage, name, tmp_path / "driver")
    fresh(storage).write_atomic(f"{name}/notes/readme.txt", b"not a checkpoint: left alone")
    state = load_state(storage, name)
    kept = [checkpoint_dir_name(i, 0, ATTEMPT_0) for i in (2, 3)]
    orphans = {checkpoint_dir_name(4, 0, ATTEMPT_0), checkpoint_dir_name(4, 1, ATTEMPT_1)}
    assert [e.dir_name for e in state.checkpoints] == kept and state.latest == kept[1]
    assert orphans <= stored_names(storage, name)  # what the crash left
    files_before = {d: stored_files(storage, f"{name}/{d}") for d in kept}

    logged: list[str] = []
    plan = start_driver(storage, name, CheckpointConfig(num_to_keep=2), logged)
    try:
        names = stored_names(storage, name)
        assert not orphans & names, names
        assert {"notes", *kept} <= names
        assert {d: stored_files(storage, f"{name}/{d}") for d in kept} == files_before
        for i, d in zip((2, 3), kept):  # every referenced checkpoint still verifies
            assert restore(storage, name, d, tmp_path) == merged(rank_files(f"c{i}"))
        assert plan.state.latest == kept[1]
        assert any("removed 2 uncommitted checkpoint directories" in m for m in logged), logged
    finally:
        plan.release()


def test_driver_start_never_removes_a_sealed_checkpoint(storage, tmp_path):
    """With num_to_keep=None old entries move to the sealed index, which a driver's start and
    end do not read (invariant 5): their directories are not in the head and must still stay.
    An orphan newer than the head's oldest entry goes at the driver's end (or, after a killed
    driver, at the next start); one older than it (a sealed checkpoint's peer, which only the
    index can tell apart) goes with the full sweep of a driver that finishes."""
    name, cfg = "sealed", CheckpointConfig()
    plan = start_driver(storage, name, cfg, [])
    manager = CheckpointManager(plan.storage, plan.store, cfg, index_chunk=2)
    for i in range(1, 6):  # chunks [1, 2] and [3, 4], the head [5]
        msgs = report_round(
            plan.storage, name, i, rank_files(f"c{i}"), {"step": i}, 0, ATTEMPT_0, tmp_path
        )
        commit_round(manager, plan.state, msgs, i, 0)
    old_orphan = report_round(
        plan.storage, name, 2, rank_files("x")[:1], {}, 1, ATTEMPT_1, tmp_path
    )[0].dir_name
    new_orphan = report_round(
        plan.storage, name, 6, rank_files("y")[:1], {}, 1, ATTEMPT_1, tmp_path
    )[0].dir_name
    plan.release()  # the driver failed: it sweeps what the head can tell on its way out
    committed = [checkpoint_dir_name(i, 0, ATTEMPT_0) for i in range(1, 6)]
    assert load_state(storage, name).sealed_chunks == 2
    names = stored_names(storage, name)
    assert set(committed) | {old_orphan} <= names and new_orphan not in names

    plan = start_driver(storage, name, cfg, [])
    try:
        assert stored_names(storage, name) == names
        for i, d in enumerate(committed, 1):
            assert restore(storage, name, d, tmp_path) == merged(rank_files(f"c{i}"))
        # the sweep of a driver that finishes reads the sealed index, and takes the older one
        full = CheckpointManager(fresh(storage), RunStore(fresh(storage), name), cfg)
        assert full.collect_orphans(load_state(storage, name)) == [old_orphan]
        assert set(committed) <= stored_names(storage, name)
    finally:
        plan.release()
