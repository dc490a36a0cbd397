"""PyTorch Lightning on ft-train (issue 44): a Lightning Trainer on 2 CPU ranks (gloo) with
ft-train's strategy, environment and report callback, under real faults. A rank SIGKILLed (or
raising) between two reported checkpoints resumes from the latest one, not step 0, its global step
continuing from the checkpoint's, and ends at max_steps; a driver killed mid-run is resumed by
rerunning the flow by name. Both packages (`lightning`, `pytorch_lightning`) and both spellings
(ft-train's `ft_train.integrations.*`, Ray's `ft_train.lightning`), parametrized across the runs.
The Trainer's default_root_dir is one directory shared by the ranks (Lightning's own
ModelCheckpoint writes there too). The training function: tests/lightning_loops.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import ft_train
from tests.conftest import StorageTarget, on_storage
from tests.helpers import REPO, fresh, load_state, run_config, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")

LOOP = "tests.lightning_loops:train_fn"
PRELOAD = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def lightning_config(tmp_path, package: str, names: str, **kw) -> dict:
    # 64 samples, 4 a batch, 2 ranks: 8 steps an epoch; a checkpoint every 2 steps (report 2 is
    # step 4)
    return {
        "package": package,
        "names": names,
        "max_steps": 8,
        "every": 2,
        "output_dir": str(tmp_path / "lightning-out"),
        **kw,
    }


@pytest.fixture(scope="module", autouse=True)
def forkserver_without_lightning():
    """The driver's fork server, started before any run of this module, imports neither Lightning
    package: one started by a `lightning` run (its preload) would give every later rank both
    packages, and Ray's names then serve `lightning`, not the `pytorch_lightning` a run imports
    alone (ft_train.lightning). The workers import a run's preload as they join instead."""
    from ft_train.driver.cluster import start_forkserver

    start_forkserver()


def cluster(package: str) -> ft_train.ClusterConfig:
    # the fork server imports Lightning once: a restarted group's ranks have it at once
    return ft_train.ClusterConfig(preload=(PRELOAD[package],))


def train_lightning(storage, name, config, max_failures=0) -> ft_train.TrainResult:
    from flows.train import train

    return train(
        train_loop=LOOP,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(storage, name, max_failures),
        cluster=cluster(config["package"]),
    )


def at(tmp_path, rank: int, step: int, kind: str) -> dict:
    return {"rank": rank, "step": step, "kind": kind, "marker": str(tmp_path / f"{kind}-{rank}")}


@pytest.mark.parametrize(
    "storage, package, names, kind, step_s",
    [
        ("local", "lightning", "ft", "kill", 0),
        ("s3", "pytorch_lightning", "ray", "kill", 0.25),  # a realistic step time
        ("local", "lightning", "ray", "raise", 0),
    ],
    indirect=["storage"],
)
def test_a_failed_rank_resumes_from_the_latest_reported_checkpoint(
    storage, tmp_path, package, names, kind, step_s
):
    # rank 1 fails at the top of step 5, after the report of step 4 (report index 2)
    config = lightning_config(tmp_path, package, names, faults=[at(tmp_path, 1, 5, kind)])
    config["step_s"] = step_s
    name = f"pl-{kind}-{package}-{names}"
    result = train_lightning(storage, name, config, max_failures=1)

    assert result.status == "finished" and result.error is None
    death = "process_death" if kind == "kill" else "exception"
    assert [(f.kind, f.rank) for f in result.failures] == [(death, 1)]
    state = load_state(storage, name)
    assert len(state.attempts) == 2
    assert state.attempts[1].restored_from.startswith("checkpoint_000002-a0-")
    # the Trainer restored the checkpoint's global step (4), not 0, and stopped at max_steps
    assert result.last_metrics["start_step"] == 4
    assert result.last_metrics["step"] == 8
    by_attempt = [
        (c.attempt, c.metrics["step"], c.metrics["start_step"]) for c in state.checkpoints
    ]
    # step 2's round may have died queued on the killed rank (reports travel in batches; the
    # ranks' journals commit the newest round they all reached, step 4's): then it is not kept
    assert by_attempt in (
        [(0, 2, 0), (0, 4, 0), (1, 6, 4), (1, 8, 4)],
        [(0, 4, 0), (1, 6, 4), (1, 8, 4)],
    ), by_attempt
    with result.checkpoint.as_directory() as d:
        # rank 0's file; the other rank attached nothing (an empty directory would be refused)
        assert [f for f in os.listdir(d) if not f.startswith(".")] == ["checkpoint.ckpt"]


EXAMPLE = "ft_train.examples.lightning_digits:train_fn"


@on_storage("local")
def test_the_example_resumes_after_its_driver_is_killed(storage, tmp_path, prefect_api):
    """The example, run by `ft-train run` as a user would; its driver (the CLI's process and its
    local cluster) SIGKILLed after the checkpoint of step 6; then the same run from Python by
    name (TorchTrainer.fit): it resumes at step 6 and ends at max_steps (8, an epoch's end report)."""
    name = "pl-example"
    hold = {"rank": 0, "step": 6, "kind": "wait", "marker": str(tmp_path / "hold")}
    config = {"max_steps": 8, "every_n_train_steps": 3, "output_dir": str(tmp_path / "out")}
    command = [sys.executable, "-m", "cli", "run", EXAMPLE, "--name", name, "--workers", "2"]
    command += ["--storage-path", storage.path, "--preload", "lightning.pytorch"]
    command += ["--preload", "sklearn.datasets"]
    command += [f"--config={k}={json.dumps(v)}" for k, v in {**config, "faults": [hold]}.items()]
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen(
            command,
            cwd=REPO,
            env=dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONPATH=REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the driver and its local cluster
        )
    try:
        wait_for(
            lambda: (s := load_state(storage, name)) is not None and s.report_index == 2,
            timeout_s=300,
            what="the example's checkpoint of step 6",
        )
        wait_for(lambda: os.path.exists(hold["marker"]), 60, "rank 0 to hold at step 6")
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    killed = load_state(storage, name)
    assert killed.status == "running", log.read_text()[-3000:]  # nothing told the run it ended
    assert killed.checkpoints[-1].metrics["step"] == 6

    import ft_train.torch

    result = ft_train.torch.TorchTrainer(
        EXAMPLE,
        train_loop_config={**config, "faults": [hold]},  # the marker exists: it holds no more
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(storage, name),
        cluster=ft_train.ClusterConfig(preload=("lightning.pytorch", "sklearn.datasets")),
    ).fit()
    state = load_state(storage, name)
    assert result.status == "finished"
    assert state.attempts[-1].restored_from == killed.latest
    assert [(f.kind, f.charged) for f in result.failures] == [("driver_crash", False)]
    assert [c.metrics["step"] for c in state.checkpoints] == [3, 6, 8]
    assert result.last_metrics["epoch"] == 0 and result.last_metrics["step"] == 8
    assert "checkpoint.ckpt" in fresh(storage).list_dir(f"{name}/{state.latest}")


def test_import_ft_train_imports_no_lightning():
    code = (
        "import sys, ft_train, ft_train.torch, ft_train.integrations; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'lightning', 'pytorch_lightning', 'lightning_fabric'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_fsdp_on_gpu_resumes_after_a_killed_rank(tmp_path, state_dict_type):
    """FSDPStrategy on one GPU a rank (NCCL): the last rank SIGKILLed at step 5 resumes from the
    checkpoint of step 4, a full state dict (rank 0's file) or a sharded one (each rank's shard
    files, in one checkpoint)."""
    storage = StorageTarget("local", str(tmp_path / "runs"))
    n = min(2, torch.cuda.device_count())
    config = lightning_config(tmp_path, "lightning", "ft", fsdp=state_dict_type)
    config["faults"] = [at(tmp_path, n - 1, 5, "kill")]
    from flows.train import train

    result = train(
        train_loop=LOOP,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=n, use_gpu=True),
        run_config=run_config(storage, f"pl-fsdp-{state_dict_type}", max_failures=1),
        cluster=cluster("lightning"),
    )
    assert result.status == "finished"
    assert [f.kind for f in result.failures] == ["process_death"]
    assert result.last_metrics["start_step"] == 4 and result.last_metrics["step"] == 8
