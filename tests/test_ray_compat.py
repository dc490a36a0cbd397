"""Ray Train's documented patterns, ported by renaming `ray.train` to `ft_train` (issue 41): the
fault-tolerance guide's examples, the getting-started loop with the checkpointing guide's restore,
and Ray's persistence test (`tests/ray_patterns.py`, `tests/ray_entrypoint.py`), each run as a
Ray user runs it (`TorchTrainer(...).fit()`) on 2 CPU ranks with a fault, and each ending
bit-identical to a fault-free run of the same function: at a realistic step time (60 ms of
compute a step) and at a few ms a step.

The fault-free runs (`reference`) are made once per function and config: a step's pace does not
change what it computes.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading

import pytest
import torch

import ft_train
from ft_train.knobs import AGREE_EVERY_MAX
from ft_train.torch import TorchTrainer
from tests import ray_patterns
from tests.conftest import StorageTarget
from tests.helpers import REPO, assert_bit_identical, fault, load_state, run_config, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")

ENTRYPOINT = os.path.join(REPO, "tests", "ray_entrypoint.py")
PACES = {"60ms-steps": 0.06, "fast-steps": 0.0}


def paced(*storages: str):
    """Each pace, on the storage named for it (the failure tests spread over the two)."""
    return pytest.mark.parametrize(
        "storage, step_s",
        list(zip(storages, PACES.values(), strict=True)),
        ids=list(PACES),
        indirect=["storage"],
    )


def fit(fn, storage, name, config, max_failures=0, cluster=None) -> ft_train.TrainResult:
    trainer = TorchTrainer(
        fn,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(storage, name, max_failures),
        **({"cluster": cluster} if cluster is not None else {}),
    )
    return trainer.fit()


def stored(checkpoint: ft_train.Checkpoint, file: str) -> dict:
    """A file of a committed checkpoint, as the loop saved it (torch.save or pickle)."""
    with checkpoint.as_directory() as d:
        path = os.path.join(d, file)
        if file.endswith(".pkl"):
            with open(path, "rb") as f:
                return pickle.load(f)
        return torch.load(path, weights_only=False)


def by_dir(result: ft_train.TrainResult) -> dict[str, dict]:
    """The metrics of each checkpoint the run kept, by its directory's name."""
    return {c.path.rstrip("/").rsplit("/", 1)[-1]: m for c, m in result.best_checkpoints}


@pytest.fixture(scope="module")
def reference(prefect_api, tmp_path_factory):
    """reference(fn, config): the result of a fault-free run of `fn` with `config` (its faults
    and pace removed), made once."""
    made: dict[str, ft_train.TrainResult] = {}

    def run(fn, config: dict) -> ft_train.TrainResult:
        clean = {k: v for k, v in config.items() if k not in ("faults", "step_s", "fail_iters")}
        key = f"{fn.__name__}:{json.dumps(clean, sort_keys=True)}"
        if key not in made:
            storage = StorageTarget("local", str(tmp_path_factory.mktemp("reference")))
            made[key] = fit(fn, storage, "reference", clean)
            assert made[key].status == "finished" and not made[key].failures
        return made[key]

    return run


# -- a. worker fault tolerance (the guide's __worker_fault_tolerance_start__) -----------------


@pytest.mark.parametrize(
    "storage, kind, step_s",
    [(s, k, p) for s, k in (("local", "raise"), ("s3", "kill")) for p in PACES.values()],
    ids=[f"{k}-{p}" for k in ("raise", "kill") for p in PACES],
    indirect=["storage"],
)
def test_worker_fault_tolerance_resumes_from_the_latest_checkpoint(
    storage, tmp_path, reference, kind, step_s
):
    """A rank raises (or is SIGKILLed) at step 7: with FailureConfig(max_failures=3), as the
    guide has it, the group restarts from the checkpoint of step 6 and ends as if nothing
    happened."""
    rank = 1 if kind == "raise" else 0
    config = {"num_steps": 12, "step_s": step_s, "faults": [fault(tmp_path, rank, 7, kind)]}
    result = fit(ray_patterns.worker_fault_tolerance, storage, "worker-ft", config, 3)
    assert result.status == "finished"
    assert [(f.rank, f.charged) for f in result.failures] == [(rank, True)]
    assert result.metrics["step"] == 11 and result.metrics["resumed_from"] == 7
    want = reference(ray_patterns.worker_fault_tolerance, config)
    assert_bit_identical(
        stored(result.checkpoint, "checkpoint.pt")["model"],
        stored(want.checkpoint, "checkpoint.pt")["model"],
    )


# -- b. the job driver's entrypoint (the guide's __job_driver_fault_tolerance_start__) --------


@paced("s3", "local")
def test_job_driver_entrypoint_sigkilled_then_rerun_resumes(
    storage, tmp_path, prefect_api, reference, step_s
):
    """`python entrypoint.py --storage_path P --run_name N`, SIGKILLed (its process group: the
    driver and its local cluster, as when its machine dies) after the checkpoint of step 5;
    the same command, run again, resumes at step 6 and ends bit-identical."""
    hold = fault(tmp_path, 0, 6, kind="wait")  # rank 0 holds there, once, for the kill
    config = {"num_steps": 12, "step_s": step_s, "faults": [hold]}
    name = "job-driver"
    command = [
        sys.executable,
        ENTRYPOINT,
        "--storage_path",
        storage.path,
        "--run_name",
        name,
        "--storage_options",
        json.dumps(storage.options),
        "--train_loop_config",
        json.dumps(config),
    ]
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONPATH=REPO)
    with open(tmp_path / "first-driver.log", "w") as log:
        driver = subprocess.Popen(
            command,
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own: the driver and its cluster
        )
    try:
        wait_for(lambda: os.path.exists(hold["marker"]), 240, "rank 0 to hold at step 6")
        wait_for(
            lambda: (s := load_state(storage, name)) is not None and s.report_index == 6,
            60,
            "the checkpoint of step 5 to be committed",
        )
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == -signal.SIGKILL, (tmp_path / "first-driver.log").read_text()

    rerun = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stdout[-6000:] + rerun.stderr[-6000:]
    result = ft_train.TrainResult.from_path(storage.path, name, storage.options)
    assert result.status == "finished"
    assert result.metrics["resumed_from"] == 6
    assert [(f.kind, f.charged) for f in result.failures] == [("driver_crash", False)]
    want = reference(ray_patterns.worker_fault_tolerance, config)
    assert_bit_identical(
        stored(result.checkpoint, "checkpoint.pt")["model"],
        stored(want.checkpoint, "checkpoint.pt")["model"],
    )


# -- c. save and restore after an error raised right after report() (test_persistence) --------


@paced("local", "s3")
def test_error_right_after_report_resumes_from_that_report(storage, reference, step_s):
    """Ray's persistence test, without its barrier: every rank raises right after the report
    of iterations 2 and 4 (rank 0 reports no checkpoint, rank 1 its shard); each restart
    resumes from the checkpoint reported just before the error. A second fit() with the same
    RunConfig (a relaunched driver) finds the run finished and trains nothing."""
    config = {
        "num_iterations": 6,
        "fail_iters": [2, 4],
        "no_checkpoint_ranks": [0],
        "step_s": step_s,
    }
    result = fit(ray_patterns.persistence, storage, "persistence", config, max_failures=2)
    assert result.status == "finished"
    assert [f.charged for f in result.failures] == [True, True]
    iters = {d: m["iter"] for d, m in by_dir(result).items()}
    restored = [a.restored_from for a in load_state(storage, "persistence").attempts]
    assert [iters.get(d) for d in restored] == [None, 2, 4]
    assert result.metrics["iter"] == 5 and result.metrics["resumed_from"] == 5
    with result.checkpoint.as_directory() as d:
        assert {"checkpoint.pkl", "checkpoint_shard-rank=1.pkl"} <= set(os.listdir(d))
        assert "checkpoint_shard-rank=0.pkl" not in os.listdir(d)

    again = fit(ray_patterns.persistence, storage, "persistence", config, max_failures=2)
    assert again.checkpoint == result.checkpoint
    assert len(load_state(storage, "persistence").attempts) == 3  # no new attempt
    want = reference(ray_patterns.persistence, config)
    assert_bit_identical(
        stored(result.checkpoint, "checkpoint.pkl")["model"],
        stored(want.checkpoint, "checkpoint.pkl")["model"],
    )


# -- d. the getting-started loop: a shuffled loader, sampler.set_epoch(epoch) -----------------


def orders(result: ft_train.TrainResult) -> dict[int, list[int]]:
    """The samples rank 0 saw in each epoch, in order, from each epoch's checkpoint."""
    return {m["epoch"]: m["order"] for _, m in result.best_checkpoints}


@paced("s3", "local")
def test_getting_started_loop_faulted_in_epoch_2_sees_the_same_batches(
    storage, tmp_path, reference, step_s
):
    """`DataLoader(shuffle=True)`, `prepare_data_loader`, `train_loader.sampler.set_epoch(epoch)`
    at each epoch, a checkpoint at each epoch's end; rank 1 raises in epoch 2's second batch.
    The restart resumes at epoch 2, whose order is epoch 2's (not epoch 0's, as a loader whose
    epoch restarts from 0 in a new process would give)."""
    config = {"num_epochs": 4, "step_s": step_s, "faults": [fault(tmp_path, 1, 9)]}
    result = fit(ray_patterns.getting_started, storage, "getting-started", config, 1)
    assert result.status == "finished" and len(result.failures) == 1
    assert result.metrics["resumed_from"] == 2
    want = reference(ray_patterns.getting_started, config)
    expected = orders(want)
    assert expected[0] != expected[1], "the shuffle gives each epoch its own order"
    got = orders(result)
    for epoch in range(4):
        again = " (epoch 0's: its sampler's epoch restarted)" if got[epoch] == expected[0] else ""
        assert got[epoch] == expected[epoch], f"epoch {epoch} saw other batches{again}"
    assert_bit_identical(stored(result.checkpoint, "model.pt"), stored(want.checkpoint, "model.pt"))


# -- e. the just-in-time checkpoint on preemption, polled (__preemption_jit_checkpoint_start__)


@pytest.fixture
def live_cluster():
    """A local Dask cluster of 3 workers (names 0, 1, 2; the ranks go to 0 and 1, in name
    order), whose workers fork from ft-train's fork server rather than import torch each."""
    import dask
    from distributed import LocalCluster

    from ft_train.driver.cluster import start_forkserver

    start_forkserver()
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        with LocalCluster(
            n_workers=3,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            memory_limit=0,
        ) as cluster:
            yield cluster


@paced("local", "s3")
def test_polled_preemption_notice_saves_a_just_in_time_checkpoint(
    storage, tmp_path, reference, live_cluster, step_s
):
    """Every rank polls `get_preemption_info()` at every step and reports a checkpoint only
    when it is not None (plus one every 40 steps). Rank 0's worker is retired
    (`Client.retire_workers`) at step 44: the loop saves at the notice, the run resumes right
    after it, later than the periodic checkpoint of step 39, and ends bit-identical."""
    from distributed import Client

    gate = fault(tmp_path, 0, 44, kind="until_preempted")  # holds until its worker has notice
    config = {"num_steps": 80, "checkpoint_every": 40, "step_s": step_s, "faults": [gate]}

    def retire_rank_0():
        wait_for(lambda: os.path.exists(gate["marker"]), 240, "rank 0 to reach step 44")
        with Client(live_cluster.scheduler_address, timeout=30) as client:
            workers = client.scheduler_info(n_workers=-1)["workers"]
            (rank_0,) = [a for a, w in workers.items() if str(w["name"]) == "0"]
            client.retire_workers([rank_0], close_workers=True)

    threading.Thread(target=retire_rank_0, daemon=True).start()
    cluster = ft_train.ClusterConfig(cluster=live_cluster)
    result = fit(ray_patterns.preemption_jit, storage, "preempted", config, 0, cluster=cluster)
    assert result.status == "finished"
    kept = by_dir(result)
    saved = {d: m for d, m in kept.items() if m["jit"]}
    assert saved, "no just-in-time checkpoint: the loop never saw get_preemption_info() set"
    assert [(f.kind, f.rank, f.charged) for f in result.failures] == [("preemption", 0, False)]
    ((jit_step,),) = {(m["step"],) for m in saved.values()}  # the loop saves once
    # the ranks agree every few polls (at most AGREE_EVERY_MAX apart), each agreement read at
    # the poll after it started: the loop learns of the notice within that many steps
    assert 44 <= jit_step <= 44 + AGREE_EVERY_MAX + 1, jit_step
    # the restart resumes from the just-in-time checkpoint, or from a later one where the loop
    # (a few ms a step) reached its end before the group stopped; never from step 39's
    restored = load_state(storage, "preempted").attempts[1].restored_from
    assert restored in kept and kept[restored]["step"] >= jit_step, (restored, kept)
    want = reference(ray_patterns.preemption_jit, config)
    assert_bit_identical(
        stored(result.checkpoint, "checkpoint.pt")["model"],
        stored(want.checkpoint, "checkpoint.pt")["model"],
    )
