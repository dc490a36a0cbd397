"""ft-train on a real SLURM cluster (tests/slurm.py: munge, slurmctld and three one-CPU slurmd
nodes on this machine), through dask-jobqueue as docs/clusters.md configures it: every Dask
worker is an `sbatch` job, `adapt` keeps a spare job's worker ready and resubmits lost ones, and
the cluster's jobs are cancelled when the run ends.

What a SLURM user meets: a job `scancel`ed mid-run and a node whose `slurmd` dies with its job
steps are lost nodes; the run resumes from the latest round on a replacement job and ends
bit-identical to a fault-free run. A walltime reached (dask-jobqueue's `--lifetime` before the
limit) is a preemption notice with a just-in-time checkpoint. Too few nodes for the run fail after
`worker_start_timeout_s` with the pending jobs and SLURM's reason for each.

Skipped, with the reason, only where SLURM cannot run (not root, not installed); under `CI` it
fails instead (`.ci/run` installs slurm-wlm and munge).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import ft_train
from tests.conftest import on_storage
from tests.helpers import (
    REPO,
    assert_bit_identical,
    demo_config,
    fault,
    final_weights,
    load_state,
    wait_for,
)
from tests.slurm import SlurmCluster, unavailable

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(900)]

WHY_NOT = unavailable()
if WHY_NOT is not None:
    if os.environ.get("CI"):
        pytest.fail(f"the SLURM tests cannot run: {WHY_NOT}", pytrace=False)
    pytest.skip(WHY_NOT, allow_module_level=True)

LOOP = "tests.loops:in_slurm_jobs"


@pytest.fixture(scope="module")
def slurm_daemons():
    # Not under pytest's basetemp, which later sessions rotate away: its logs (slurmctld's, every
    # job's) are what a failure here is read from; the path is printed after each test.
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="ft-train-slurm-")), nodes=3).start()
    cluster.activate()  # dask-jobqueue's sbatch/squeue/scancel run in this process
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm(slurm_daemons):
    """The cluster with every node idle and no job left from an earlier test; what the
    controller saw, and its log's last lines, are printed after each test (shown on failure)."""
    slurm_daemons.settle()
    yield slurm_daemons
    print(f"SLURM after the test ({slurm_daemons.root}):", slurm_daemons.describe())
    print(slurm_daemons.log_tail())


def slurm_cluster(tmp_path: Path, spare: int = 1, lifetime: str | None = None, **kw):
    """docs/clusters.md's SLURM settings, sized for this machine: one worker (one rank) per job,
    one CPU, ft-train's Dask settings in the job's prologue, the fork-server preload, and adapt
    holding `ranks + spare` jobs."""
    extra = [
        "--preload-nanny",
        "ft_train.worker.forkserver",
        "--preload",
        "ft_train.driver.cluster",
    ]
    if lifetime is not None:
        extra += ["--lifetime", lifetime, "--lifetime-stagger", "0s"]
    jobs = kw.pop("jobs", 2 + spare)
    return ft_train.ClusterConfig(
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs={
            "cores": 1,
            "processes": 1,
            "memory": "1GB",
            "walltime": kw.pop("walltime", "00:30:00"),
            "queue": "debug",
            "python": sys.executable,
            # each job's output, beside the cluster's own logs (kept after the session)
            "log_directory": str(Path(os.environ["SLURM_CONF"]).parent / "jobs" / tmp_path.name),
            "scheduler_options": {"host": "127.0.0.1"},
            "job_script_prologue": [
                f"cd {REPO}",
                f"export PYTHONPATH={REPO}",
                "export DASK_CONFIG=${TMPDIR:-/tmp}/ft-train-dask-$SLURM_JOB_ID.yaml",
                f'{sys.executable} -m cli dask-config > "$DASK_CONFIG"',
            ],
            "worker_extra_args": extra,
            **kw,
        },
        adapt_kwargs={"minimum": jobs, "maximum": jobs},
    )


def rank_job(jobs_dir: Path, rank: int, attempt_jobs: set[str] = frozenset()) -> str:
    """The SLURM job rank `rank` trains in now (written by the loop when it starts)."""
    path = jobs_dir / f"rank-{rank}"
    return wait_for(
        lambda: path.exists() and (j := path.read_text()) not in attempt_jobs and j,
        240,
        f"rank {rank} to start in a job",
    )


def train(storage, name, config, cluster, **kw):
    from flows.train import train as flow

    failure = ft_train.FailureConfig(max_failures=kw.pop("max_failures", 2), **kw.pop("fc", {}))
    return flow(
        train_loop=LOOP,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=180),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=storage.path,
            storage_options=storage.options,
            failure_config=failure,
        ),
        cluster=cluster,
    )


def first_report_after(result, t: float) -> float:
    """Seconds from `t` (epoch s) to the first report of a group started after it: the first
    point of the run's metric history past the failure recorded after `t` (the points between
    are the stopped group's last reports). Printed for bench/README.md's SLURM figures."""
    failed = min(f.time.timestamp() for f in result.failures if f.time.timestamp() >= t - 1)
    return min(p["time"] for p in result.metrics_history if p["time"] > failed) - t


def in_background(fn) -> dict:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # reported by the test's assertion
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


@on_storage("local")
def test_a_cancelled_job_and_a_dead_node_are_lost_nodes_and_the_run_ends_bit_identical(
    storage, tmp_path, slurm
):
    """Rank 1's job `scancel`ed when it reaches step 7 (after the step-5 checkpoint), then, in the
    next group, the node of rank 0's job killed (its slurmd and the job's processes, SIGKILL at
    once); adapt submits a job in place of each; the run resumes and ends with the weights of a
    fault-free run. `scancel` sends the job SIGTERM, then SIGKILL `KillWait` later (2 s here):
    a notice, so an uncharged preemption, resumed from the latest committed round as no
    just-in-time checkpoint was saved in time. The dead node is a node loss, charged."""
    jobs_dir = tmp_path / "ranks"
    jobs_dir.mkdir()
    hold1 = fault(tmp_path, 1, 7, kind="wait")
    hold2 = fault(tmp_path, 0, 16, kind="wait")
    config = demo_config([hold1, hold2], epochs=2, jobs_dir=str(jobs_dir))
    acted: dict = {}

    def faults():
        wait_for(lambda: os.path.exists(hold1["marker"]), 400, "rank 1 to reach step 7")
        first = rank_job(jobs_dir, 1)
        acted["scancel"] = (first, time.time())
        slurm.scancel(first)
        wait_for(lambda: os.path.exists(hold2["marker"]), 400, "rank 0 to reach step 16")
        job = rank_job(jobs_dir, 0)
        node = slurm.running()[job]
        acted["node"] = (node, job, time.time())
        slurm.kill_node(node)
        slurm.restart_node(node)  # the machine back: SLURM returns it to service (ReturnToService)

    chaos = in_background(faults)
    result = train(storage, "slurm-faults", config, slurm_cluster(tmp_path))
    chaos["thread"].join(30)
    assert "error" not in chaos, chaos.get("error")
    assert result.status == "finished", (result.error, slurm.describe())
    kinds = [(f.kind, f.rank, f.charged) for f in result.failures]
    assert kinds == [("preemption", 1, False), ("node_loss", 0, True)], result.failures
    assert result.failures[0].time.timestamp() - acted["scancel"][1] < 15
    state = load_state(storage, "slurm-faults")
    assert [a.restored_from[:17] for a in state.attempts[1:]] == [
        "checkpoint_000005",
        "checkpoint_000015",
    ]
    print(
        f"\nSLURM: scancel -> first resumed report {first_report_after(result, acted['scancel'][1]):.1f} s; "
        f"slurmd killed -> first resumed report {first_report_after(result, acted['node'][2]):.1f} s"
    )
    reference_config = demo_config(epochs=2, jobs_dir=str(tmp_path))  # on a local cluster
    reference = train(storage, "slurm-reference", reference_config, ft_train.ClusterConfig())
    assert_bit_identical(final_weights(result), final_weights(reference))
    # the cluster closed with the run: its jobs are cancelled
    wait_for(lambda: not slurm.running(), 60, f"the run's jobs to end: {slurm.describe()}")


@on_storage("local")
def test_too_few_nodes_fail_naming_the_pending_jobs_and_their_reason(storage, tmp_path, slurm):
    """Four jobs of one CPU asked of three one-CPU nodes: the fourth stays pending, and the run
    fails after worker_start_timeout_s naming it and SLURM's reason."""
    from flows.train import train as flow

    started = time.monotonic()
    with pytest.raises(ft_train.WorkerStartupError) as err:
        flow(
            train_loop=LOOP,
            train_loop_config=demo_config(jobs_dir=str(tmp_path)),
            scaling_config=ft_train.ScalingConfig(num_workers=4, worker_start_timeout_s=30),
            run_config=ft_train.RunConfig(
                name="slurm-too-few", storage_path=storage.path, storage_options=storage.options
            ),
            cluster=slurm_cluster(tmp_path, jobs=4),
        )
    message = str(err.value)
    assert time.monotonic() - started < 200
    assert "as squeue says" in message and "pending" in message, message
    assert "Resources" in message or "Priority" in message, message
    wait_for(lambda: not slurm.running(), 60, f"the run's jobs to end: {slurm.describe()}")


@on_storage("local")
def test_a_walltime_is_a_preemption_notice_with_a_just_in_time_checkpoint(storage, tmp_path, slurm):
    """The jobs' workers retire at dask-jobqueue's `--lifetime`, before the job's walltime: the
    ranks have notice, save a just-in-time checkpoint, and the run goes on on the jobs adapt
    submits in their place, charged to max_preemption_failures (max_failures is 0)."""
    jobs_dir = tmp_path / "ranks"
    jobs_dir.mkdir()
    # rank 0 holds at step 7 until its worker is told to leave: the lifetime runs out there
    gate = fault(tmp_path, 0, 7, kind="until_preempted")
    config = demo_config([gate], epochs=2, jobs_dir=str(jobs_dir))
    cluster = slurm_cluster(tmp_path, lifetime="100s", walltime="00:03:00")
    result = train(
        storage,
        "slurm-walltime",
        config,
        cluster,
        max_failures=0,
        fc={"preemption_notice_s": 60, "agreement_interval_s": 0},
    )
    assert result.status == "finished", (result.error, slurm.describe())
    assert result.failures and {(f.kind, f.charged) for f in result.failures} == {
        ("preemption", False)
    }, result.failures
    # every rank learned of the notice at step 8's call; the loop's just-in-time checkpoint
    # (report 9) was committed before the workers left, and the run resumed from it
    assert result.last_metrics["resumed_from"] == 8
    notice = result.failures[0].time.timestamp()
    print(
        f"\nSLURM: walltime notice -> first report on the replacement jobs {first_report_after(result, notice):.1f} s"
    )
    wait_for(lambda: not slurm.running(), 60, f"the run's jobs to end: {slurm.describe()}")


DRIVER = """
import json, sys
import ft_train
from flows.train import train
args = json.loads(sys.argv[1])
train(
    train_loop=args["loop"],
    train_loop_config=args["config"],
    scaling_config=ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=180),
    run_config=ft_train.RunConfig(name=args["name"], storage_path=args["storage_path"]),
    cluster=ft_train.ClusterConfig.model_validate(args["cluster"]),
)
"""


@on_storage("local")
def test_a_killed_driver_is_rerun_by_name_on_new_jobs(storage, tmp_path, slurm):
    """The driver (its SLURMCluster's scheduler with it) SIGKILLed at step 7, after the step-5
    checkpoint; the flow run again by name starts new jobs and resumes from step 5; the old
    jobs' workers, their scheduler gone, end their jobs (`death_timeout`, 60 s)."""
    import json
    import signal
    import subprocess

    jobs_dir = tmp_path / "ranks"
    jobs_dir.mkdir()
    hold = fault(tmp_path, 1, 7, kind="wait")
    config = demo_config([hold], jobs_dir=str(jobs_dir))
    # dask-jobqueue's death_timeout (60 s) as users have it: it also bounds a worker's first
    # start under its nanny (the fork server's imports), which took over 30 s on a loaded host
    cluster = slurm_cluster(tmp_path)
    args = {
        "loop": LOOP,
        "config": config,
        "name": "slurm-driver",
        "storage_path": storage.path,
        "cluster": cluster.model_dump(mode="json"),
    }
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(args)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        start_new_session=True,
    )
    try:
        wait_for(lambda: os.path.exists(hold["marker"]), 400, "rank 1 to reach step 7")
        old_jobs = set(slurm.running())
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    (jobs_dir / "rank-1").unlink()
    result = train(storage, "slurm-driver", config, slurm_cluster(tmp_path))
    assert result.status == "finished", (result.error, slurm.describe())
    assert result.last_metrics["resumed_from"] == 5
    assert (jobs_dir / "rank-1").read_text() not in old_jobs  # trained in a new job
    assert [f.kind for f in result.failures] == ["driver_crash"], result.failures
    wait_for(
        lambda: not set(slurm.running()) & old_jobs, 120, f"the old jobs to end: {slurm.describe()}"
    )
