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

import json
import re
import subprocess
import uuid

import pytest

import ft_train
from tests import postgres
from tests.conftest import on_storage
from tests.prefect_e2e import PREFECT, REPO, call, client_env, deployed, tail

DEPLOYMENT = "ft-train/demo"


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def prefect_server(request):
    """The environment that points Prefect clients at a running server, on each database: the
    session's on SQLite (the same server `prefect server start` runs; a second one here would
    cost ~15 s), and `prefect server start` on PostgreSQL, as production runs it. Every test
    of this module, through this fixture or `demo_deployment`, runs on both."""
    api = request.getfixturevalue("prefect_api" if request.param == "sqlite" else "postgres_api")
    return client_env(api)


@pytest.fixture(scope="module")
def demo_deployment(prefect_server, tmp_path_factory):
    """The work pool, the `demo` deployment from prefect.yaml, and a worker polling the pool;
    yields (environment, worker log)."""
    with deployed(prefect_server, ["demo"], tmp_path_factory.mktemp("worker")) as log:
        yield prefect_server, log


@on_storage("s3")  # storage_options as a deployment parameter, as a team passes them
@pytest.mark.timeout(420)
def test_demo_deployment_trains_to_the_end(demo_deployment, storage, request):
    env, worker_log = demo_deployment
    api = env["PREFECT_API_URL"]
    name = f"e2e-{storage.kind}-{uuid.uuid4().hex[:8]}"

    deployment = call("GET", f"{api}/deployments/name/{DEPLOYMENT}", timeout=10).json()
    assert deployment["enforce_parameter_schema"] is True
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ], "the pull step should name the project directory, resolved when deploying"

    # the credentials come from the worker's environment (AWS_*): a deployment refuses them in
    # its parameters, which the Prefect server stores (tests/test_secrets.py). A run config given
    # in part: the deployment's failure budget and retention (num_to_keep=2) are kept
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
    output = f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n--- worker log ---\n{tail(worker_log)}"
    assert done.returncode == 0, f"the deployment run did not complete:\n{output}"

    match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert match, f"no flow run id in the output:\n{output}"
    flow_run = call("GET", f"{api}/flow_runs/{match.group(1)}", timeout=10).json()
    assert flow_run["state_type"] == "COMPLETED", output
    assert flow_run["name"] == name, "the flow run should be named after run_config.name"
    assert flow_run["deployment_id"] == deployment["id"]
    if request.node.callspec.params["prefect_server"] == "postgresql":  # stored there, not SQLite
        row = postgres.stored_flow_run(request.getfixturevalue("postgres_database"), match.group(1))
        assert row == (name, "COMPLETED"), row

    result = ft_train.TrainResult.from_path(storage.path, name, storage_options=storage.options)
    assert result.status == "finished"
    assert result.checkpoint is not None
    # steps 5, 10 and 12 were checkpointed; the deployment's num_to_keep=2 kept the last two
    assert sorted(m["step"] for _, m in result.best_checkpoints) == [10, 12], result
    assert "step" in result.last_metrics
    assert result.failures == []
