"""The in-memory snapshot tier (`ft_train.worker.snapshots`) and the just-in-time save.

A rank's snapshot pieces are held by a peer worker's nanny. On a local cluster the nannies run
in the driver's process, which is this test's: a test reads (and damages) what they hold through
`snapshot_store.STORES`, as a measurement or a bit flip in their memory would. Losing a holder
takes a cluster whose nannies are processes of their own (`dask worker`, one per node).

Each fault test runs the loop at a few ms a step and at 50 ms a step, and checks the final
weights bit for bit against a run without faults.
"""

from __future__ import annotations

import os

import pytest
import torch

import ft_train
from tests.conftest import StorageTarget
from tests.helpers import assert_bit_identical, load_state, run_config

pytestmark = pytest.mark.usefixtures("prefect_api")

FAST = "tests.loops:fast_checkpoints"
EVERY = 20  # a checkpoint on storage every 20 reports
SNAP = 2  # a snapshot every 2
STEPS = 48
PACES = [0.0, 0.05]  # seconds of compute a step, beyond the loop's few ms


def train_fast(target, name, config, max_failures=0, snapshot_every=SNAP, **kw):
    from flows.train import train

    return train(
        train_loop=FAST,
        train_loop_config={"steps": STEPS, "every": EVERY, **config},
        scaling_config=ft_train.ScalingConfig(num_workers=kw.pop("workers", 2)),
        run_config=run_config(
            target,
            name,
            max_failures,
            checkpoint_config=ft_train.CheckpointConfig(snapshot_every=snapshot_every),
        ),
        **kw,
    )


def weights(result: ft_train.TrainResult) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "rank0.pt"))["model"]


def kill(rank, step, tmp_path, kind="kill") -> dict:
    return {"rank": rank, "step": step, "kind": kind, "marker": str(tmp_path / f"{kind}-{step}")}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> dict[str, torch.Tensor]:
    target = StorageTarget("local", str(tmp_path_factory.mktemp("fault-free") / "runs"))
    result = train_fast(target, "fault-free", {}, snapshot_every=None)
    assert result.status == "finished" and not result.failures
    return weights(result)


def local(tmp_path) -> StorageTarget:
    return StorageTarget("local", str(tmp_path / "runs"))


@pytest.mark.parametrize("pace", PACES)
def test_a_rank_killed_between_checkpoints_resumes_from_the_newest_snapshot(
    tmp_path, pace, fault_free
):
    # SIGKILL right after report 27: the checkpoint on storage is at 20, snapshots at 22..26.
    # report() 26 returned once the killed rank's piece of 24 was held; 26's may be on its way.
    target, name = local(tmp_path), f"snap-kill-{pace}"
    config = {"snapshot": True, "step_s": pace, "faults": [kill(1, 27, tmp_path)]}
    result = train_fast(target, name, config, max_failures=1)

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("process_death", 1, 27)]
    restart = load_state(target, name).attempts[1]
    assert restart.restored_from is not None and restart.restored_from.startswith(
        "checkpoint_000020-"
    )
    assert restart.start_report_index in (24, 26), restart
    assert restart.restored_snapshot.startswith(f"snapshot {restart.start_report_index} ")
    assert_bit_identical(weights(result), fault_free)


@pytest.mark.parametrize("pace", PACES)
def test_the_survivors_save_just_in_time_when_a_rank_raises(tmp_path, pace, fault_free):
    # No snapshots: rank 1 raises right after report 27; rank 0, in step 28's all-reduce, loses
    # its peer and saves the state of report 27, which the restart resumes from.
    target, name = local(tmp_path), f"jit-{pace}"
    config = {"jit": True, "step_s": pace, "faults": [kill(1, 27, tmp_path, "raise")]}
    result = train_fast(target, name, config, max_failures=1, snapshot_every=None)

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("exception", 1, 27)]
    restart = load_state(target, name).attempts[1]
    assert restart.start_report_index == 27, restart
    assert restart.restored_snapshot.startswith("jit 27 "), restart
    assert_bit_identical(weights(result), fault_free)
