"""End to end through a deployment, the way a user runs it: a running Prefect server, a process
work pool, `prefect deploy -n demo` from prefect.yaml, `prefect worker start`, and
`prefect deployment run 'ft-train/demo'`; then the run's stored result is read back without Prefect.

Once on the session's server (SQLite), once on `prefect server start` backed by a PostgreSQL
server of the test's own (`tests/postgres.py`); one pool, deployment and worker for each. The
run stores on the loopback S3, its storage options passed as a deployment parameter (local storage
is the CLI demo's). The worker runs in an empty directory with no project path added:
the flow-run process finds the code only through the deployment's pull step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

import ft_train
from tests.conftest import on_storage

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
POOL = "ft-train-process"
DEPLOYMENT = "ft-train/demo"


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def _start(args: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """A long-running CLI process in its own process group, output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
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


def _cli(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """A Prefect CLI command from the repository root; fails the test with its output."""
    done = subprocess.run(
        PREFECT + args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, (
        f"`prefect {' '.join(args)}` exited {done.returncode}:\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    return done


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def prefect_server(request):
    """The environment that points Prefect clients at a running server, on each database: the
    session's on SQLite (the same server `prefect server start` runs; a second one here would
    cost ~15 s), and `prefect server start` on PostgreSQL, as production runs it. Every test
    of this module, through this fixture or `demo_deployment`, runs on both."""
    api = request.getfixturevalue("prefect_api" if request.param == "sqlite" else "postgres_api")
    return {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "COLUMNS": "200",  # keep the CLI's rich output on one line per item
    }


@pytest.fixture(scope="module")
def demo_deployment(prefect_server, tmp_path_factory):
    """The work pool, the `demo` deployment from prefect.yaml, and a worker polling the pool;
    yields (environment, worker log)."""
    env = prefect_server
    _cli(["work-pool", "create", POOL, "--type", "process"], env, timeout_s=120)
    _cli(["--no-prompt", "deploy", "-n", "demo"], env, timeout_s=180)

    workdir = tmp_path_factory.mktemp("worker")  # not the project: the pull step must get there
    log = workdir / "worker.log"
    worker_env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}  # pick a new run up at once
    worker = _start(PREFECT + ["worker", "start", "--pool", POOL], worker_env, workdir, log)
    try:
        yield env, log
    finally:
        _stop(worker)


@on_storage("s3")  # storage_options as a deployment parameter, as a team passes them
@pytest.mark.timeout(420)
def test_demo_deployment_trains_to_the_end(demo_deployment, storage, request):
    env, worker_log = demo_deployment
    api = env["PREFECT_API_URL"]
    name = f"e2e-{storage.kind}-{uuid.uuid4().hex[:8]}"

    deployment = httpx.get(f"{api}/deployments/name/{DEPLOYMENT}", timeout=10).json()
    assert deployment["enforce_parameter_schema"] is True
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ], "the pull step should name the project directory, resolved when deploying"

    # the credentials come from the worker's environment (AWS_*): a deployment refuses them in
    # its parameters, which the Prefect server stores (tests/test_secrets.py)
    options = {"endpoint_url": storage.options["endpoint_url"]}
    run_config = {"name": name, "storage_path": storage.path, "storage_options": options}
    done = subprocess.run(
        PREFECT
        + [
            "deployment",
            "run",
            DEPLOYMENT,
            "--param",
            f"run_config={json.dumps(run_config)}",
            "--param",
            'train_loop_config={"epochs": 1, "checkpoint_every": 5}',
            "--watch",
            "--watch-timeout",
            "240",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = (
        f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n--- worker log ---\n{_tail(worker_log)}"
    )
    assert done.returncode == 0, f"the deployment run did not complete:\n{output}"

    match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert match, f"no flow run id in the output:\n{output}"
    flow_run = httpx.get(f"{api}/flow_runs/{match.group(1)}", timeout=10).json()
    assert flow_run["state_type"] == "COMPLETED", output
    assert flow_run["name"] == name, "the flow run should be named after run_config.name"
    assert flow_run["deployment_id"] == deployment["id"]
    if request.node.callspec.params["prefect_server"] == "postgresql":  # stored there, not SQLite
        row = stored_flow_run(request.getfixturevalue("postgres_database"), match.group(1))
        assert row == (name, "COMPLETED"), row

    result = ft_train.TrainResult.from_path(storage.path, name, storage_options=storage.options)
    assert result.status == "finished"
    assert result.checkpoint is not None and len(result.best_checkpoints) >= 1
    assert "step" in result.metrics
    assert result.failures == []


def stored_flow_run(database_url: str, flow_run_id: str) -> tuple[str, str] | None:
    """(name, state type) of a flow run as the server's PostgreSQL database holds it."""
    import asyncio

    import asyncpg

    async def read() -> tuple[str, str] | None:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            row = await conn.fetchrow(
                "SELECT name, state_type FROM flow_run WHERE id = $1", uuid.UUID(flow_run_id)
            )
        finally:
            await conn.close()
        return None if row is None else (row["name"], str(row["state_type"]))

    return asyncio.run(read())
