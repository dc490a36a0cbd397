"""Hugging Face Transformers' Trainer on ft-train (`ft_train.integrations.transformers`, and
Ray's names in `ft_train.huggingface.transformers`): a tiny GPT-2 built from a config, on 2 CPU
ranks that share one output_dir, through the Trainer's own distributed set-up (accelerate) on
ft-train's group. A rank killed or raising between two saves, and a killed driver whose run is
rerun by name, resume from the latest reported checkpoint: the Trainer's global_step goes on
from that checkpoint's and ends at max_steps. One local cluster for the module (the ranks fork
from a server that has imported Transformers), one Prefect API for the session."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ft_train
from ft_train.storage.run_state import RunState
from tests.conftest import StorageTarget
from tests.helpers import fault, load_state, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")

REPO = str(Path(__file__).resolve().parents[1])
EXAMPLE = "ft_train.examples.gpt2_trainer:train_fn"
RAY_GUIDE = "tests.transformers_loops:ray_guide"
# What the ranks import beyond torch: imported once by the workers' fork server
PRELOAD = ["transformers.trainer", "transformers.models.gpt2.modeling_gpt2", "ft_train.examples"]


@pytest.fixture(scope="module")
def cluster():
    """A local Dask cluster of 3 workers (2 ranks and a spare), whose workers fork from
    ft-train's fork server; a killed rank's worker is replaced by its nanny."""
    import dask
    from distributed import LocalCluster

    from ft_train.driver.cluster import start_forkserver

    start_forkserver(PRELOAD)  # False where it runs already: each worker imports PRELOAD then
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        with LocalCluster(
            n_workers=3,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            memory_limit=0,
        ) as live:
            yield ft_train.ClusterConfig(cluster=live, preload=PRELOAD)


def train(train_loop, storage, name, config, cluster, max_failures=0) -> ft_train.TrainResult:
    from flows.train import train as flow

    return flow(
        train_loop=train_loop,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=storage.path,
            failure_config=ft_train.FailureConfig(max_failures=max_failures),
        ),
        cluster=cluster,
    )


def steps_by_attempt(state: RunState) -> dict[int, list[int]]:
    """The Trainer's global_step of each committed checkpoint, by the attempt that saved it."""
    steps: dict[int, list[int]] = {}
    for c in state.checkpoints:
        steps.setdefault(c.attempt, []).append(c.metrics["step"])
    return steps


def trainer_state(result: ft_train.TrainResult) -> dict:
    with result.checkpoint.as_directory() as d:
        return json.loads(Path(d, "checkpoint", "trainer_state.json").read_text())


def assert_resumed_from(storage, name, result, step, then, final_step):
    """The restart restored the checkpoint of `step` (not step 0), its Trainer saved `then`,
    and the final checkpoint's Trainer state ends at `final_step` with the history logged
    before the failure (restored from the checkpoint, not begun again)."""
    state = load_state(storage, name)
    (restored,) = [c for c in state.checkpoints if c.metrics["step"] == step]
    assert state.attempts[-1].restored_from == restored.dir_name
    assert steps_by_attempt(state)[len(state.attempts) - 1] == then
    final = trainer_state(result)
    assert final["global_step"] == final_step == result.last_metrics["step"]
    assert [e["step"] for e in final["log_history"] if "loss" in e][0] < step
    with result.checkpoint.as_directory() as d:
        files = set(os.listdir(os.path.join(d, "checkpoint")))
    # every rank's RNG state, and rank 0's model, optimizer, scheduler and Trainer state
    want = {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"}
    assert want | {"scheduler.pt", "trainer_state.json"} <= files, files


def test_a_killed_rank_resumes_from_the_latest_reported_checkpoint(tmp_path, cluster):
    """ft-train's names (the example as it ships): rank 1 is SIGKILLed at step 7, between the
    saves of steps 5 and 10, with save_total_limit=2 in the output_dir both ranks share."""
    storage = StorageTarget("local", str(tmp_path / "runs"))
    out = tmp_path / "hf"
    config = {
        "max_steps": 20,
        "save_steps": 5,
        "save_total_limit": 2,
        "logging_steps": 1,
        "output_dir": str(out),
        "faults": [fault(tmp_path, 1, 7, "kill")],
    }
    result = train(EXAMPLE, storage, "hf-kill", config, cluster, max_failures=1)
    assert result.status == "finished"
    assert [(f.kind, f.rank) for f in result.failures] == [("process_death", 1)]
    assert steps_by_attempt(load_state(storage, "hf-kill"))[0] == [5]
    assert_resumed_from(storage, "hf-kill", result, step=5, then=[10, 15, 20], final_step=20)
    # the Trainer's own rotation in the shared output_dir, after each folder was reported
    assert sorted(os.listdir(out)) == ["checkpoint-15", "checkpoint-20"]


@pytest.mark.parametrize(
    "train_loop, save",
    [(EXAMPLE, "steps"), (RAY_GUIDE, "epoch")],
    ids=["ft-train-names-steps-realistic-pace", "ray-names-epoch-fast"],
)
def test_a_rank_that_raises_resumes_from_the_latest_reported_checkpoint(
    tmp_path, cluster, train_loop, save
):
    storage = StorageTarget("local", str(tmp_path / "runs"))
    if save == "steps":  # 0.2 s a step; saves at 4, 8, 12; rank 0 raises at step 6
        config = {"max_steps": 12, "save_steps": 4, "step_s": 0.2}
        step, then, final = 4, [8, 12], 12
    else:  # 6 steps an epoch (96 sequences, 8 a rank), 3 epochs; rank 0 raises at step 8
        config = {"max_steps": -1, "epochs": 3, "n_sequences": 96, "save_strategy": "epoch"}
        step, then, final = 6, [12, 18], 18
    config |= {"output_dir": str(tmp_path / "hf"), "logging_steps": 2}
    config["faults"] = [fault(tmp_path, 0, 6 if save == "steps" else 8, "raise")]
    result = train(train_loop, storage, "hf-raise", config, cluster, max_failures=1)
    assert result.status == "finished"
    assert [(f.kind, f.rank) for f in result.failures] == [("exception", 0)]
    assert "InjectedFault" in result.failures[0].error
    assert_resumed_from(storage, "hf-raise", result, step=step, then=then, final_step=final)


def test_a_killed_driver_is_rerun_by_name_and_resumes(tmp_path, cluster, prefect_api):
    """The driver is `ft-train run` of the example (a process of its own, with its own local
    cluster), SIGKILLed with its cluster while rank 0 holds right after the save of step 10; the
    flow is run again by name from Python and resumes from that save."""
    storage = StorageTarget("local", str(tmp_path / "runs"))
    hold = {"rank": 0, "step": 10, "kind": "wait", "marker": str(tmp_path / "hold")}
    config = {"max_steps": 15, "save_steps": 5, "output_dir": str(tmp_path / "hf")}
    config["faults"] = [hold]
    args = [sys.executable, "-m", "cli", "run", EXAMPLE, "--name", "hf-driver", "--workers", "2"]
    args += ["--storage-path", storage.path, *[f"--preload={m}" for m in PRELOAD]]
    args += [f"--config={k}={json.dumps(v)}" for k, v in config.items()]
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen(
            args,
            cwd=REPO,
            env=dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONPATH=REPO),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the driver and its local cluster
        )
    try:
        wait_for(
            lambda: os.path.exists(hold["marker"]) or driver.poll() is not None,
            timeout_s=300,
            what="rank 0 to hold after the save of step 10",
        )
        assert driver.poll() is None, log.read_text()[-5000:]
        wait_for(
            lambda: (s := load_state(storage, "hf-driver")) is not None and s.report_index == 2,
            timeout_s=60,
            what="the save of step 10 to be committed",
        )
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    killed = load_state(storage, "hf-driver")
    assert killed.status == "running" and steps_by_attempt(killed) == {0: [5, 10]}

    result = train(EXAMPLE, storage, "hf-driver", config, cluster)
    assert result.status == "finished"
    assert [(f.kind, f.charged) for f in result.failures] == [("driver_crash", False)]
    assert_resumed_from(storage, "hf-driver", result, step=10, then=[15], final_step=15)


def test_import_ft_train_imports_none_of_the_extras():
    """`import ft_train` (and its Ray names) stays free of the optional frameworks."""
    code = (
        "import sys, ft_train, ft_train.huggingface, ft_train.integrations\n"
        "extras = {'transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'mlflow',"
        " 'tensorboard'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & extras))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_each_rank_attaches_only_the_files_it_wrote(tmp_path):
    """Rank 0: everything but the other ranks' RNG states; rank k: its own RNG state only."""
    from ft_train.huggingface.transformers import RayTrainReportCallback
    from ft_train.integrations.transformers import ReportCallback, rank_files

    folder = tmp_path / "checkpoint-10"
    (folder / "sub").mkdir(parents=True)
    names = ["model.safetensors", "optimizer.pt", "trainer_state.json", "sub/shard.bin"]
    for name in [*names, "rng_state_0.pth", "rng_state_1.pth", "rng_state_12.pth"]:
        (folder / name).write_bytes(b"x")
    assert rank_files(str(folder), 0) == sorted([*names, "rng_state_0.pth"])
    assert rank_files(str(folder), 1) == ["rng_state_1.pth"]
    assert rank_files(str(folder), 12) == ["rng_state_12.pth"]
    assert rank_files(str(folder), 2) == []
    assert RayTrainReportCallback is ReportCallback
    assert RayTrainReportCallback.CHECKPOINT_NAME == "checkpoint"  # Ray's layout
