"""`ft-train dask-config`: the settings ft-train gives its own clusters, as a file that a
`dask scheduler` and `dask worker` started by someone else read (docs/clusters.md)."""

import os
import subprocess
import sys
from pathlib import Path

from distributed import Client

from ft_train.driver.cluster import DASK_SETTINGS
from ft_train.worker.rank import free_port

REPO = str(Path(__file__).resolve().parents[1])
DASK = str(Path(sys.executable).parent / "dask")


def test_a_cluster_started_with_the_file_runs_with_ft_trains_settings(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cli", "dask-config"], cwd=REPO, capture_output=True, check=True
    )
    path = tmp_path / "ft-train.yaml"
    path.write_bytes(out.stdout)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "MALLOC_"))}
    env["DASK_CONFIG"] = str(path)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cmds = [
        [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
        [DASK, "worker", address, "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1"],
    ]
    log = open(tmp_path / "dask.log", "w")
    procs = [subprocess.Popen(c, env=env, stdout=log, stderr=subprocess.STDOUT) for c in cmds]
    try:
        with Client(address, timeout=60) as c:
            c.wait_for_workers(1, timeout=60)

            def seen(dask_worker=None):
                import dask

                return {
                    "config": {
                        k: dask.config.get(k)
                        for k in DASK_SETTINGS
                        if ".scheduler." in k or ".worker." in k or ".admin." in k
                    },
                    "env": {
                        k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")
                    },
                    "profiling": dask_worker is not None
                    and "profile" in dask_worker.periodic_callbacks,
                }

            (worker,) = c.run(seen).values()
            scheduler = c.run_on_scheduler(seen)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    want = {k: v for k, v in DASK_SETTINGS.items() if k in worker["config"]}
    assert worker["config"] == want and scheduler["config"] == want
    assert scheduler["config"]["distributed.scheduler.allowed-failures"] == 0
    assert worker["env"] == {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": None}
    assert worker["profiling"] is False
