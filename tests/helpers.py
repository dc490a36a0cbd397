"""Helpers the test modules share: run the demo flow, read stored state, wait on it, write a
foreign driver's lease, read prefect.yaml. A test module imports these from here, never from
another test module (`tests/unit/test_quick_lane.py` checks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import ft_train
from deployments import demo
from ft_train.driver.lease import LEASE_FILE, LeaseDoc
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore, now

DEMO = demo.TRAIN_LOOP
REPO = str(Path(__file__).resolve().parents[1])


def run_config(storage, name, max_failures=0, **kw) -> ft_train.RunConfig:
    """The demo's run identity on a test's storage. A failure budget of 0 unless a test asks
    (the demo's is 1): a test that expects no failure fails at the first."""
    return ft_train.RunConfig(
        name=name,
        storage_path=storage.path,
        storage_options=storage.options,
        failure_config=kw.pop("failure_config", ft_train.FailureConfig(max_failures=max_failures)),
        **kw,
    )


def demo_config(faults=(), epochs=1, **kw) -> dict:
    """The demo's train_loop_config (`deployments/demo.py`), for 1 epoch unless a test asks: the
    tests' runs are short. The fault steps the tests pick assume its checkpoint every 5 steps."""
    return {**demo.TRAIN_LOOP_CONFIG, "epochs": epochs, "faults": list(faults), **kw}


def fault(tmp_path, rank, step, kind="raise") -> dict:
    return {
        "rank": rank,
        "step": step,
        "kind": kind,
        "marker": str(tmp_path / f"fault-{rank}-{step}"),
    }


def train_demo(
    storage,
    name,
    config,
    max_failures=0,
    workers=demo.SCALING_CONFIG["num_workers"],
    use_gpu=False,
    **kw,
) -> ft_train.TrainResult:
    from flows.train import train

    return train(
        train_loop=DEMO,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=run_config(storage, name, max_failures),
        **kw,
    )


def fresh(target) -> Storage:
    """A new Storage on a test's storage target (no state shared with the code under test)."""
    return Storage(target.path, target.options)


def load_state(storage, name) -> RunState | None:
    return RunStore(fresh(storage), name).load()


def wait_for(predicate, timeout_s: float, what: str):
    """Poll a condition on stored state until it holds (a bounded wait, not a sleep to sync)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def final_weights(result: ft_train.TrainResult) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "train_state.pt"), weights_only=False)["model"]


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def events_of(name: str) -> list:
    """Run `name`'s ft-train events (`tasks/publish.py`) on the Prefect API, oldest first."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(
            EventFilter(
                event=EventNameFilter(prefix=["ft-train."]),
                resource=EventResourceFilter(id=[f"ft-train.run.{name}"]),
            ),
            limit=50,
        )
    return sorted(page.events, key=lambda e: e.occurred)


def run_killed(script: str, args: dict) -> subprocess.CompletedProcess:
    """Run `script` (Python source) with `args` as JSON in argv[1], in a process of its own that
    must end by SIGKILL (the script kills itself where a real fault would strike)."""
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    return proc


def foreign_lease(
    target, name: str, ttl_s: float, renewals: int = 0, age_s: float = 0.0
) -> LeaseDoc:
    """Write the lease of a driver on another machine, last renewed `age_s` ago."""
    at = now() - timedelta(seconds=age_s)
    doc = LeaseDoc(
        owner="elsewhere-owner",
        machine="another-machine",
        host="node-7",
        pid=4242,
        pid_started=1.0,
        holder="flow run 'nightly' (x)",
        ttl_s=ttl_s,
        acquired_at=at,
        renewed_at=at,
        renewals=renewals,
    )
    fresh(target).write_atomic(f"{name}/{LEASE_FILE}", doc.model_dump_json().encode())
    return doc


def noop_train_loop(config: dict) -> None:
    """An importable train_loop for runs that never call it (`prepare_noop`)."""


def prepare_noop(target, name: str, holder: str = ""):
    """What a driver does before its ranks start (`prepare_run`: lease, run state, orphan sweep)
    for the run `name` on a test's storage target, of a train_loop never called."""
    from ft_train.driver import prepare

    return prepare.prepare_run(
        f"{__name__}:noop_train_loop",
        {},
        ft_train.ScalingConfig(),
        ft_train.RunConfig(name=name, storage_path=target.path, storage_options=target.options),
        log=lambda msg: None,
        holder=holder,
    )


def deployment(name: str) -> dict[str, Any]:
    """The deployment `name` of the repository's prefect.yaml, as YAML data."""
    project = yaml.safe_load((Path(REPO) / "prefect.yaml").read_text())
    (found,) = [d for d in project["deployments"] if d["name"] == name]
    return found


def needs(what: str, why_missing: str | None) -> None:
    """A test that needs a system program (PostgreSQL, Chromium, ...): skipped where it is
    missing (`why_missing`, naming the install), except under CI (`CI` set), which installs
    everything the tests need (`.ci/run`): there a missing one fails the test."""
    if why_missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what}: {why_missing}; CI installs it (.ci/run), so this is a failure there")
    pytest.skip(f"{what}: {why_missing}")


def stored_by_prefect(names: list[str]) -> dict[str, str]:
    """Everything the Prefect API holds of the flow runs named `names`, as JSON by where."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.events.filters import EventFilter, EventOccurredFilter

    stored: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names))
        )
        assert sorted(r.name for r in runs) == sorted(names)
        ids = [r.id for r in runs]
        by_id = FlowRunFilter(id=FlowRunFilterId(any_=ids))
        for run in runs:
            assert run.parameters["run_config"]["name"] in names  # parameters are there
            stored[f"flow run {run.name}"] = run.model_dump_json()
        tasks = client.read_task_runs(flow_run_filter=by_id)
        stored["task runs"] = json.dumps([t.model_dump(mode="json") for t in tasks])
        logs, offset = [], 0
        while page := client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)), limit=200, offset=offset
        ):
            logs += [log.model_dump(mode="json") for log in page]
            offset += len(page)
        assert any("committed" in log["message"] for log in logs)  # the runs' logs are there
        stored["logs"] = json.dumps(logs)
        artifacts = client.read_artifacts(flow_run_filter=by_id)
        assert artifacts  # the runs' artifacts are there
        stored["artifacts"] = json.dumps([a.model_dump(mode="json") for a in artifacts])
        since = min(r.created for r in runs if r.created is not None)
        page = client.read_events(EventFilter(occurred=EventOccurredFilter(since=since)), 50)
        events = list(page.events)
        while page.next_page is not None:
            page = client.read_events_page(page.next_page)
            events += page.events
        assert any(e.event == "ft-train.checkpoint.committed" for e in events)
        stored["events"] = json.dumps([e.model_dump(mode="json") for e in events])
    return stored


def start_driver_process(args: dict, api_url: str, log: Path) -> subprocess.Popen:
    """`tests/driver_script.py` with `args` (its JSON arguments) in a process group of its own
    (the driver and its local Dask cluster), for a test that kills the driver."""
    env = dict(os.environ, PREFECT_API_URL=api_url, PYTHONPATH=REPO)
    return subprocess.Popen(
        [sys.executable, str(Path(REPO) / "tests" / "driver_script.py"), json.dumps(args)],
        env=env,
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def deadline(seconds: float) -> float:
    """A `time.monotonic()` deadline `seconds` from now, for an API that takes one (a close's);
    the quick lane reads no clock of its own (tests/unit/test_quick_lane.py)."""
    return time.monotonic() + seconds
