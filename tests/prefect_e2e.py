"""Prefect as the end-to-end tests run it, the way a user does: `prefect server start` (on SQLite in
a home of its own, or on a PostgreSQL URL), the process work pool with deployments from
prefect.yaml, a `prefect worker start` polling it, and the CLI calls in between.

Every `prefect server start` of the tests starts here: one on PostgreSQL per session
(`postgres_api` in tests/conftest.py), and tests/test_recovery_e2e.py's on SQLite, which needs the
scheduler that the session's test harness (`prefect_api`, an ephemeral server) does not run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from ft_train.worker.rank import free_port
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
POOL = "ft-train-process"


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def start(args: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """A long-running CLI process in its own process group, output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a process, its process group, and every descendant (the worker's flow-run supervisor
    starts its own process group, and Dask workers hang below it): TERM, then KILL after grace_s."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:  # already gone: only the group may be left
        family = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        _, family = psutil.wait_procs(family, timeout=grace_s)
        if not family and proc.poll() is not None:
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def cli(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """A Prefect CLI command from the repository root; fails the test with its output."""
    done = subprocess.run(
        PREFECT + args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, (
        f"`prefect {' '.join(args)}` exited {done.returncode}:\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return done


def client_env(api: str) -> dict:
    """The environment that points Prefect clients (CLI, worker, flow runs) at `api`."""
    return {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "COLUMNS": "200",  # keep the CLI's rich output on one line per item
    }


@contextlib.contextmanager
def server(workdir: Path, database_url: str | None = None, **settings: str) -> Iterator[str]:
    """`prefect server start` on loopback with a Prefect home of its own under `workdir`, on
    `database_url` (default: SQLite in that home), with these extra PREFECT_* settings; yields
    its API URL once it answers."""
    port, log = free_port(), workdir / "prefect-server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(workdir / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        **settings,
    )
    if database_url is not None:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    args = ["server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    proc = start(PREFECT + args, env, workdir, log)
    api = f"http://127.0.0.1:{port}/api"
    try:
        wait_for(lambda: _healthy(api) or proc.poll() is not None, 180, f"the server ({log})")
        assert proc.poll() is None, f"prefect server start exited {proc.returncode}:\n{tail(log)}"
        yield api
    finally:
        stop(proc)


# The codes Prefect's own client retries (prefect/client/base.py): a server on SQLite under load
# answers 503 when its database is locked, and a client is expected to ask again.
RETRY_CODES = frozenset({429, 502, 503})


def call(method: str, url: str, tries: int = 6, timeout: float = 10, **kwargs) -> httpx.Response:
    """One request to a Prefect API, asked again with a growing pause (0.5 s, 1 s, ... 8 s) while
    the server answers with a code its own client retries; the last answer otherwise."""
    for attempt in range(tries - 1):
        reply = httpx.request(method, url, timeout=timeout, **kwargs)
        if reply.status_code not in RETRY_CODES:
            return reply
        time.sleep(min(0.5 * 2**attempt, 8.0))
    return httpx.request(method, url, timeout=timeout, **kwargs)


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def deployed(
    env: dict, names: list[str], workdir: Path, automations: bool = False
) -> Iterator[Path]:
    """The process work pool, these deployments from prefect.yaml, the recovery automations if
    asked (`ft-train automations install`), and a worker polling the pool from `workdir` (not the
    project: the deployment's pull step must get there); yields the worker's log. The pool is
    overwritten if it exists: the session's servers outlive a module."""
    cli(["work-pool", "create", POOL, "--type", "process", "--overwrite"], env, timeout_s=120)
    cli(["--no-prompt", "deploy", *(a for n in names for a in ("-n", n))], env, timeout_s=240)
    if automations:
        install = [sys.executable, "-m", "cli", "automations", "install", "--within", "90"]
        done = subprocess.run(
            install, env=env, cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "installed ft-train-rerun/ft-train/demo" in done.stdout, done.stdout
    log = workdir / "worker.log"
    worker_env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}  # pick a new run up at once
    worker = start(PREFECT + ["worker", "start", "--pool", POOL], worker_env, workdir, log)
    try:
        yield log
    finally:
        stop(worker)
