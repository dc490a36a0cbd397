"""`ft-train dask-config`: the settings ft-train gives its own clusters, as a file that a
`dask scheduler` and `dask worker` started by someone else read (docs/clusters.md)."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from distributed import Client

from ft_train.driver.dask_settings import DASK_SETTINGS, warn_if_not_in_force
from ft_train.worker.rank import free_port
from tests.helpers import wait_for

REPO = str(Path(__file__).resolve().parents[1])
DASK = str(Path(sys.executable).parent / "dask")
# as docs/clusters.md starts a worker
PRELOADS = ["--preload-nanny", "ft_train.worker.forkserver", "--preload", "ft_train.driver.cluster"]


@contextlib.contextmanager
def cli_cluster(tmp_path, config_file: str | None):
    """A `dask scheduler` and one `dask worker` (a nanny and its worker process), as someone
    else starts them: with `config_file` in DASK_CONFIG, or with Dask's defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "MALLOC_"))}
    if config_file:
        env["DASK_CONFIG"] = config_file
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cmds = [
        [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
        [DASK, "worker", address, "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1"]
        + (PRELOADS if config_file else []),
    ]
    log = open(tmp_path / "dask.log", "w")
    procs = [subprocess.Popen(c, env=env, stdout=log, stderr=subprocess.STDOUT) for c in cmds]
    try:
        with Client(address, timeout=60) as c:
            c.wait_for_workers(1, timeout=60)
            yield c
    finally:
        for p in procs:
            p.kill()
            p.wait()
        log.close()


def test_a_cluster_started_with_the_file_runs_with_ft_trains_settings(tmp_path, caplog):
    out = subprocess.run(
        [sys.executable, "-m", "cli", "dask-config"], cwd=REPO, capture_output=True, check=True
    )
    path = tmp_path / "ft-train.yaml"
    path.write_bytes(out.stdout)

    def seen(dask_worker=None):
        import dask

        return {
            "config": {
                k: dask.config.get(k)
                for k in DASK_SETTINGS
                if ".scheduler." in k or ".worker." in k or ".admin." in k
            },
            "env": {k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")},
            "profiling": dask_worker is not None and "profile" in dask_worker.periodic_callbacks,
            # forked from a server that imported torch before the worker began (not the nanny)
            "parent_has_torch": "libtorch" in open(f"/proc/{os.getppid()}/maps").read(),
        }

    def nanny_status(dask_worker) -> str:  # run on a nanny (Client.run(..., nanny=True))
        return dask_worker.status.name

    with cli_cluster(tmp_path, str(path)) as c:
        (worker,) = c.run(seen).values()
        scheduler = c.run_on_scheduler(seen)
        warn_if_not_in_force(c)
        # a worker that replaces a lost one starts with torch imported, as the first did
        (address,) = c.scheduler_info()["workers"]
        # a nanny whose worker dies before the nanny's own start is done gives up (Dask's way)
        wait_for(lambda: list(c.run(nanny_status, nanny=True).values()) == ["running"], 30, "nanny")
        os.kill(c.run(os.getpid)[address], signal.SIGKILL)
        wait_for(lambda: set(c.scheduler_info()["workers"]) - {address}, 60, "a new worker")
        (replacement,) = c.run(seen).values()
    want = {k: v for k, v in DASK_SETTINGS.items() if k in worker["config"]}
    assert worker["config"] == want and scheduler["config"] == want
    assert scheduler["config"]["distributed.scheduler.allowed-failures"] == 0
    assert worker["env"] == {"MALLOC_ARENA_MAX": "1", "MALLOC_TRIM_THRESHOLD_": None}
    assert worker["profiling"] is False
    assert worker["parent_has_torch"] and replacement["parent_has_torch"]
    assert replacement["env"] == worker["env"]
    assert not [r for r in caplog.records if "ft-train" in r.getMessage()]


def test_a_cluster_started_without_the_file_is_told_what_it_lacks(tmp_path, caplog):
    with cli_cluster(tmp_path, None) as c:
        warn_if_not_in_force(c)
    (warned,) = [
        r.getMessage() for r in caplog.records if "ft-train's Dask settings" in r.getMessage()
    ]
    scheduler_part, worker_part = warned.split("; ", 1)
    assert "distributed.scheduler.allowed-failures" in scheduler_part
    assert worker_part.startswith("1 of 1 workers lack")
    for key in (
        "distributed.worker.profile.enabled",
        "distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX",
    ):
        assert key in worker_part
    assert "distributed.scheduler.allowed-failures" not in worker_part
    assert "`ft-train dask-config`" in warned
