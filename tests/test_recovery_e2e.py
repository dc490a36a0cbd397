"""Hands-off driver recovery and scheduled runs, end to end: `prefect server start` on loopback
(its scheduler and automation services), the process work pool, `prefect deploy -n demo -n
nightly` from prefect.yaml, `ft-train automations install`, and `prefect worker start`.

- A deployed run's flow process is SIGKILLed after a checkpoint: a new flow run starts by
  itself (the rerun automation), resumes from that checkpoint and completes. Also on the
  session's `prefect server start` on PostgreSQL (tests/postgres.py), there for a run given no
  name: the rerun resumes the name its flow run generated. The rest runs on SQLite.
- A training function that kills its driver every time: the driver-restart budget stops the
  reruns, and the run ends Failed with an error that names the setting.
- The scheduler creates two runs of a scheduled deployment: each is named after its slot and
  trains a run of its own.

The deployments train `tests.loops` functions (a few ms a step) on one rank, on local storage.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest

import ft_train
from ft_train.driver.lease import read_lease
from ft_train.run_name import GENERATED
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore
from tests import postgres, prefect_e2e
from tests.helpers import wait_for
from tests.prefect_e2e import call, cli, client_env, tail


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """`prefect server start` on SQLite, its scheduler looking every 2 s (default 60) so a test's
    slots are scheduled at once; the pool, both deployments from prefect.yaml, the recovery
    automations and a worker; yields (environment, worker log)."""
    settings = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    with prefect_e2e.server(tmp_path_factory.mktemp("prefect-server"), **settings) as api:
        env = client_env(api)
        workdir = tmp_path_factory.mktemp("worker")
        with prefect_e2e.deployed(env, ["demo", "nightly"], workdir, automations=True) as log:
            yield env, log


@pytest.fixture(scope="module")
def deployed_on_postgres(postgres_api, tmp_path_factory):
    """The session's `prefect server start` on PostgreSQL (tests/conftest.py), with the `demo`
    deployment, the recovery automations and a worker; yields (environment, worker log)."""
    env, workdir = client_env(postgres_api), tmp_path_factory.mktemp("worker-postgres")
    with prefect_e2e.deployed(env, ["demo"], workdir, automations=True) as log:
        yield env, log


_DEPLOYED = {"sqlite": "deployed", "postgresql": "deployed_on_postgres"}


@pytest.fixture
def database(request) -> str:
    """The database of the server a test runs on, "sqlite" or "postgresql" (an indirect
    parametrization); its module's deployment is made in the test's setup, as a fixture's is."""
    request.getfixturevalue(_DEPLOYED[request.param])
    return request.param


def _api(env: dict) -> str:
    return env["PREFECT_API_URL"]


def _run(env: dict, deployment: str, parameters: dict, job_variables: dict | None = None) -> str:
    """`prefect deployment run` with these parameters; the flow run's id."""
    args = ["deployment", "run", deployment]
    for key, value in parameters.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    for key, value in (job_variables or {}).items():
        args += ["--job-variable", f"{key}={json.dumps(value)}"]
    out = cli(args, env, timeout_s=120).stdout
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert match, out
    return match.group(1)


def _flow_runs(env: dict, name: str) -> list[dict]:
    """The flow runs named `name` (a driver names its flow run after the run), oldest first."""
    body = {"flow_runs": {"name": {"any_": [name]}}, "sort": "EXPECTED_START_TIME_ASC"}
    return call("POST", f"{_api(env)}/flow_runs/filter", json=body, timeout=10).json()


def _state(env: dict, flow_run_id: str) -> str:
    return call("GET", f"{_api(env)}/flow_runs/{flow_run_id}", timeout=10).json()["state_type"]


def _fast(storage_path: str, name: str | None, **loop) -> dict:
    """A deployment run's parameters: tests.loops.fast_checkpoints on one rank (a run without a
    name where `name` is None: given as null, since a run_config given in part keeps the
    deployment's other fields, and the demo deployment's name is "demo")."""
    return {
        "train_loop": "tests.loops:fast_checkpoints",
        "train_loop_config": {"steps": 20, "every": 5, **loop},
        "run_config": {"storage_path": storage_path, "name": name},
        "scaling_config": {"num_workers": 1},
        "cluster": {"preload": []},
    }


@pytest.mark.parametrize(
    "database, named",
    [
        pytest.param("sqlite", True, id="sqlite"),
        # The database and the naming are independent: one run each way covers both (a third,
        # sqlite-unnamed, cost another ~35 s of the suite for no further path).
        pytest.param("postgresql", False, id="postgresql-unnamed"),
    ],
    indirect=["database"],
)
@pytest.mark.timeout(600)  # with the module's setup: 1-4 min on 2 loaded cores
def test_a_killed_driver_is_rerun_and_resumes_from_its_checkpoint(
    database, named, request, tmp_path
):
    """On both of the server's databases: the crash reaches the rerun through the server's
    events, automation and state tables. The other tests here run on SQLite only. Unnamed (on
    PostgreSQL): the run's name is generated by its first flow run, which is named so; the rerun
    must resume that run (its own id would generate another name)."""
    env, worker_log = request.getfixturevalue(_DEPLOYED[database])
    runs, name = str(tmp_path / "runs"), f"crash-{uuid.uuid4().hex[:6]}" if named else None
    hold = {"rank": 0, "step": 10, "kind": "wait", "marker": str(tmp_path / "hold")}
    first = _run(env, "ft-train/demo", _fast(runs, name, faults=[hold]))
    store = Storage(runs)
    if name is None:  # the one run under `runs`, named after the flow run
        name = wait_for(lambda: os.path.isdir(runs) and os.listdir(runs), 240, tail(worker_log))[0]
        assert GENERATED.fullmatch(name) and name.endswith(first.replace("-", "")[-8:]), name

    def held() -> bool:
        state = RunStore(store, name).load()
        return state is not None and state.report_index == 10 and os.path.exists(hold["marker"])

    wait_for(held, 240, f"the run to hold after its checkpoint at step 10\n{tail(worker_log)}")
    lease = read_lease(store, name)
    assert lease is not None and lease.holder_id == first
    checkpoint = ft_train.TrainResult.from_path(runs, name).checkpoint.path
    os.kill(lease.pid, signal.SIGKILL)  # the flow-run process only, as the OOM killer would

    def rerun_done() -> dict | None:
        later = [r for r in _flow_runs(env, name) if r["id"] != first]
        return later[0] if later and later[0]["state_type"] in ("COMPLETED", "FAILED") else None

    rerun = wait_for(rerun_done, 240, f"a rerun to end\n{tail(worker_log)}")
    assert _state(env, first) == "CRASHED"
    assert rerun["state_type"] == "COMPLETED", tail(worker_log)
    assert rerun["parameters"]["run_config"]["name"] == name
    assert rerun["parameters"]["train_loop_config"]["faults"] == [hold]  # the same parameters
    result = ft_train.TrainResult.from_path(runs, name)
    assert result.status == "finished" and result.last_metrics["step"] == 20
    assert result.last_metrics["resumed_from"] == 10
    assert [(f.kind, f.charged) for f in result.failures] == [("driver_crash", False)]
    assert checkpoint.rsplit("/", 1)[-1].startswith("checkpoint_000010-")
    if database == "postgresql":  # the server stored both runs there, not in a SQLite file
        database_url = request.getfixturevalue("postgres_database")
        assert postgres.stored_flow_run(database_url, first) == (name, "CRASHED")
        assert postgres.stored_flow_run(database_url, rerun["id"]) == (name, "COMPLETED")


@pytest.mark.timeout(600)  # with the module's setup: 1-4 min on 2 loaded cores
def test_a_driver_killed_every_time_stops_after_the_restart_budget(deployed, tmp_path):
    env, worker_log = deployed
    runs, name = str(tmp_path / "runs"), f"loop-{uuid.uuid4().hex[:6]}"
    parameters = {
        "train_loop": "tests.loops:kill_driver",
        "train_loop_config": {"storage_path": runs},
        "run_config": {
            "name": name,
            "storage_path": runs,
            "failure_config": {"max_driver_restarts": 1},
        },
        "scaling_config": {"num_workers": 1},
        "cluster": {"preload": []},
    }
    _run(env, "ft-train/demo", parameters)

    def failed() -> list[dict] | None:
        found = _flow_runs(env, name)
        return found if any(r["state_type"] == "FAILED" for r in found) else None

    found = wait_for(failed, 360, f"the run to fail\n{tail(worker_log)}")
    # two drivers killed (the first run, and the rerun the budget allowed), then the third fails
    assert [r["state_type"] for r in found] == ["CRASHED", "CRASHED", "FAILED"], found
    state = call("GET", f"{_api(env)}/flow_runs/{found[-1]['id']}", timeout=10).json()["state"]
    assert "max_driver_restarts=1" in state["message"], state
    result = ft_train.TrainResult.from_path(runs, name)
    assert result.status == "failed" and "max_driver_restarts" in str(result.error)
    assert [f.kind for f in result.failures] == ["driver_crash", "driver_crash"]
    assert all(not f.charged for f in result.failures)  # max_failures is not spent by them


@pytest.mark.timeout(600)  # with the module's setup: 1-4 min on 2 loaded cores
def test_a_driver_that_crashes_before_the_flow_runs_is_not_rerun(deployed, tmp_path):
    """The flow-run process cannot import the flow (here: its environment shadows `distributed`,
    which the flow imports and Prefect's engine does not, with a package that fails to import):
    Crashed before the flow ran. A rerun would crash the same
    way, so none starts (the reruns above are created within seconds of a crash)."""
    env, worker_log = deployed
    broken = tmp_path / "site" / "distributed"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken environment')\n")
    demo = call("GET", f"{_api(env)}/deployments/name/ft-train/demo", timeout=10).json()
    before = {r["id"] for r in _deployment_runs(env, demo["id"])}
    parameters = _fast(str(tmp_path / "runs"), f"broken-{uuid.uuid4().hex[:6]}")
    first = _run(env, "ft-train/demo", parameters, {"env": {"PYTHONPATH": str(broken.parent)}})
    crashed = wait_for(
        lambda: _state(env, first) in ("CRASHED", "FAILED", "COMPLETED"), 240, tail(worker_log)
    )
    assert crashed and _state(env, first) == "CRASHED", tail(worker_log)
    flow_run = call("GET", f"{_api(env)}/flow_runs/{first}", timeout=10).json()
    assert flow_run["run_count"] == 0  # the flow never ran
    assert "a broken environment" in tail(worker_log, 20000)
    # Nothing to wait on for an automation that does not fire, so a bounded wait for nothing:
    # the rerun automation evaluates the Crashed event as the server receives it (before this
    # test saw CRASHED, give or take the event bus) and its action creates the rerun's flow run
    # at once, before any worker picks it up. 10 s (it was 30): the matched crashes of the
    # tests above get their rerun within a few seconds.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        others = {r["id"] for r in _deployment_runs(env, demo["id"])} - before - {first}
        assert not others, f"a rerun started: {others}"
        time.sleep(1)


def _deployment_runs(env: dict, deployment_id: str) -> list[dict]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}}
    return call("POST", f"{_api(env)}/flow_runs/filter", json=body, timeout=10).json()


@pytest.mark.timeout(600)  # with the module's setup: 1-4 min on 2 loaded cores
def test_the_scheduler_starts_runs_named_after_their_slots(deployed, tmp_path):
    """Two slots 20 s apart of a schedule on the `nightly` deployment: two flow runs, each
    named after its slot by the deployment's own name template, each its own finished run."""
    env, worker_log = deployed
    api, runs = _api(env), str(tmp_path / "runs")
    nightly = call("GET", f"{api}/deployments/name/ft-train/nightly", timeout=10).json()
    template = nightly["parameters"]["run_config"]["name"]
    assert template == "nightly-{scheduled_start:%Y%m%d-%H%M}"
    assert [s["active"] for s in nightly["schedules"]] == [False]  # prefect.yaml's, off
    start = (datetime.now(UTC) + timedelta(seconds=15)).replace(microsecond=0)
    rrule = f"DTSTART:{start:%Y%m%dT%H%M%SZ}\nRRULE:FREQ=SECONDLY;INTERVAL=20;COUNT=2"
    parameters = _fast(runs, template.replace("%H%M", "%H%M%S"), steps=10)
    schedule = {"schedule": {"rrule": rrule, "timezone": "UTC"}, "active": True}
    reply = call(
        "POST",
        f"{api}/deployments/{nightly['id']}/schedules",
        json=[{**schedule, "parameters": parameters}],
        timeout=10,
    )
    assert reply.status_code == 201, reply.text
    expected = [f"nightly-{slot:%Y%m%d-%H%M%S}" for slot in (start, start + timedelta(seconds=20))]

    def both_done() -> bool:
        return all([r["state_type"] for r in _flow_runs(env, n)] == ["COMPLETED"] for n in expected)

    wait_for(both_done, 300, f"both scheduled runs to complete\n{tail(worker_log)}")
    for name in expected:
        (flow_run,) = _flow_runs(env, name)
        assert flow_run["deployment_id"] == nightly["id"]
        assert flow_run["auto_scheduled"] is True  # the scheduler's, not ours
        result = ft_train.TrainResult.from_path(runs, name)
        assert result.status == "finished" and result.last_metrics["step"] == 10
        assert result.last_metrics["resumed_from"] == 0  # trained from scratch, not the other's
