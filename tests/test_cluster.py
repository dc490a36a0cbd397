"""The local cluster's workers: forked from a fork server that imported torch, in the driver's
environment; spawned where forking cannot give that environment."""

import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import uuid

from ft_train.config import ClusterConfig, ScalingConfig
from ft_train.driver import cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def probe() -> dict:
    """Run on a worker as soon as it is up, before any rank imported anything."""
    return {
        "ppid": os.getppid(),
        "torch_loaded": "torch._dynamo" in sys.modules,
        "demo_loaded": "sklearn.datasets" in sys.modules,  # conftest's set_forkserver_preload
        "var": os.environ.get("FT_TEST_VAR"),
        "region": os.environ.get("AWS_DEFAULT_REGION"),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
    }


def allocates_from_main_heap() -> bool:
    """Run as a Dask task, on a worker's executor thread, where a rank trains: whether a block
    of 64 KiB (past the thread's cache, under glibc's mmap threshold) comes from the process's
    main heap rather than an arena of the thread's own (see dask_settings.DASK_SETTINGS)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    block = libc.malloc(64 * 1024)
    try:
        with open("/proc/self/maps") as f:
            heap = [line.split()[0] for line in f if line.rstrip().endswith("[heap]")]
        return any(int(lo, 16) <= block < int(hi, 16) for lo, hi in (r.split("-") for r in heap))
    finally:
        libc.free(block)


def workers() -> list[dict]:
    with cluster.dask_client(ClusterConfig(), ScalingConfig(num_workers=2)) as client:
        seen = client.run(probe)
        on_main_heap = client.gather(
            [client.submit(allocates_from_main_heap, workers=[w], pure=False) for w in seen]
        )
        callbacks = {
            n for n, pc in client.cluster.scheduler.periodic_callbacks.items() if pc.is_running()
        }
        return [
            dict(w, main_heap=m, scheduler_callbacks=callbacks)
            for w, m in zip(seen.values(), on_main_heap)
        ]


def test_workers_fork_from_a_server_with_torch_imported_and_see_the_drivers_environment(
    monkeypatch,
):
    assert cluster.start_forkserver()
    server_pid = multiprocessing.forkserver._forkserver._forkserver_pid
    value = uuid.uuid4().hex
    monkeypatch.setenv("FT_TEST_VAR", value)  # set after the fork server started
    seen = workers()
    assert len(seen) == 3  # two ranks and the spare
    for w in seen:
        assert w["ppid"] == server_pid, w  # forked, not spawned by the driver
        assert w["torch_loaded"], w
        assert w["demo_loaded"], w  # and what the user added to the fork server's preload
        assert w["var"] == value, w
        assert w["omp"] == "1", w  # Dask's pre-spawn variables, as with spawned workers
        assert w["malloc_trim"] is None, w  # but not the one ft-train unsets (throughput)
        assert w["main_heap"], w  # a rank's thread has no arena of its own (throughput)
    # nothing to steal or replicate: no wake-ups for it in the driver (throughput)
    assert not {c for c in seen[0]["scheduler_callbacks"] if c == "stealing" or c.startswith("amm")}
    # nor for the checks of settings that are off (idle-timeout, no-workers-timeout: None)
    assert not {"idle-timeout", "no-workers-timeout"} & seen[0]["scheduler_callbacks"]
    assert (
        "worker-ttl" in seen[0]["scheduler_callbacks"]
    )  # while the checks of those that are on run


def test_starting_the_fork_server_leaves_the_drivers_environment_as_it_was():
    code = (
        "import os; from ft_train.driver import cluster\n"
        "before = dict(os.environ); assert cluster.start_forkserver()\n"
        "assert cluster._forkserver_env['MALLOC_ARENA_MAX'] == '1'  # the workers' variables\n"
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True, timeout=120)


def test_a_variable_removed_since_the_fork_server_started_makes_workers_spawn(monkeypatch):
    assert cluster.start_forkserver()
    assert "AWS_DEFAULT_REGION" in cluster._forkserver_env  # conftest sets it before any server
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    assert cluster._worker_start() == ("spawn", {})
    seen = workers()
    for w in seen:
        assert w["ppid"] == os.getpid(), w  # spawned by the nanny in this process
        assert w["region"] is None, w  # a forked worker would still have it
        assert w["main_heap"], w
    monkeypatch.undo()
    method, env = cluster._worker_start()
    assert method == "forkserver" and "AWS_DEFAULT_REGION" not in env


DRIVER = """
import json, sys
sys.path.insert(0, {repo!r})
import psutil
import ft_train
from ft_train.driver import cluster
from flows.train import train

taken, take = [], cluster._take_ahead
cluster._take_ahead = lambda *a: taken.append(take(*a)) or taken[-1]  # observe, not replace
import flows.train
started, ahead = [], flows.train.Ahead
flows.train.Ahead = lambda *a: started.append(a) or ahead(*a)  # likewise

def call(name, train_loop, resume="auto", **cluster_kw):
    try:
        train(train_loop=train_loop, train_loop_config={{"n": 3}},
              scaling_config=ft_train.ScalingConfig(num_workers=2),
              run_config=ft_train.RunConfig(name=name, storage_path={storage!r}, resume=resume),
              cluster=ft_train.ClusterConfig(**cluster_kw))
        error = None
    except Exception as e:
        error = type(e).__name__
    workers = [p for p in psutil.Process().children(recursive=True)
               if "forkserver" not in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]
    return [error, cluster._forkserver_env is not None, [t is not None for t in taken], len(workers)]

out = {{}}
out["address"] = call("address", "no_such_module_ft:fn", address="tcp://127.0.0.1:9")
out["bad_loop"] = call("bad-loop", "no_such_module_ft:fn")  # fails before the flow starts anything
taken.clear()
out["trains"] = call("trains", "tests.loops:report_many")
started.clear(); taken.clear()
out["rerun"] = call("trains", "tests.loops:report_many") + [len(started)]  # it had finished
started.clear(); taken.clear()
out["never"] = call("trains", "tests.loops:report_many", resume="never") + [len(started)]
started.clear(); taken.clear()
out["must"] = call("no-such-run", "tests.loops:report_many", resume="must") + [len(started)]
from ft_train.driver import prepare
held = prepare.prepare_run("tests.loops:report_many", {{"n": 3}}, ft_train.ScalingConfig(num_workers=2),
                          ft_train.RunConfig(name="held", storage_path={storage!r}),
                          log=lambda m: None)  # another driver (in this process) trains "held"
started.clear(); taken.clear()
out["locked"] = call("held", "tests.loops:report_many") + [len(started)]
print(json.dumps(out))
"""


def test_a_python_call_of_the_flow_starts_its_local_cluster_ahead_and_the_run_takes_it(
    prefect_api, tmp_path
):
    """The cluster (forking from a server that imports torch) starts while Prefect starts; a run
    on an existing cluster, a rerun of a finished run, a call for a run that another driver
    trains or that `resume` refuses starts nothing, and a call that fails early leaves nothing
    running."""
    script = DRIVER.format(repo=REPO, storage=str(tmp_path / "runs"))
    env = dict(os.environ, PREFECT_API_URL=prefect_api)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["address"] == ["TrainLoopImportError", False, [], 0], out  # nothing started
    assert out["bad_loop"] == ["TrainLoopImportError", False, [], 0], out  # refused before it
    assert out["trains"] == [None, True, [True], 0], out  # the run took the cluster started ahead
    assert out["rerun"] == [None, True, [], 0, 0], out  # a finished run's: none started
    assert out["locked"] == ["RunLockedError", True, [], 0, 0], out  # nor a refused one's
    assert out["never"] == ["ConfigError", True, [], 0, 0], out  # refused by resume="never"
    assert out["must"] == ["ConfigError", True, [], 0, 0], out  # and by resume="must"


def pid_of(_batch) -> int:
    return os.getpid()


def loader_worker_pids(n: int) -> list[int]:
    """Run as a rank would: start a DataLoader with worker processes and keep it."""
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        range(n), num_workers=n, persistent_workers=True, collate_fn=pid_of
    )
    loader_worker_pids.kept = loader  # its processes live while the rank does
    return sorted(set(iter(loader)))


PRELOADED = """
import json, sys
sys.path.insert(0, {repo!r})
from ft_train.driver import cluster
from ft_train.config import ClusterConfig, ScalingConfig

with cluster.dask_client(ClusterConfig(preload=["wave"]), ScalingConfig(num_workers=1)) as client:
    print(json.dumps([client.run(lambda: "wave" in sys.modules), "wave" in sys.modules]))
"""


def test_cluster_preload_is_imported_by_the_fork_server_that_workers_fork_from():
    """A process of its own: this one's fork server has started already."""
    proc = subprocess.run(
        [sys.executable, "-c", PRELOADED.format(repo=REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    on_workers, in_driver = json.loads(proc.stdout.splitlines()[-1])
    assert list(on_workers.values()) == [True, True], on_workers  # the rank's worker and the spare
    assert not in_driver  # imported there, not here


def test_a_killed_workers_loader_processes_go_with_it():
    import psutil

    with cluster.dask_client(ClusterConfig(), ScalingConfig(num_workers=1)) as client:
        (addr, worker_pid), *_ = client.run(os.getpid).items()
        pids = client.submit(loader_worker_pids, 2, workers=[addr], pure=False).result()
        assert len(pids) == 2 and worker_pid not in pids
        # forked from the rank's process, as on a plain Linux process: not spawned (which
        # imports torch again in each, seconds every epoch) nor from a fork server of the rank's
        loaders = [psutil.Process(p) for p in pids]
        assert all(p.ppid() == worker_pid for p in loaders)
        assert not any("spawn_main" in " ".join(p.cmdline()) for p in loaders), loaders[0].cmdline()
        os.kill(worker_pid, signal.SIGKILL)
        # a DataLoader worker checks every 5 s that its parent, the rank's process, lives
        alive = psutil.wait_procs([psutil.Process(p) for p in pids], timeout=30)[1]
        assert not alive, f"the loader's processes outlived their rank: {alive}"
