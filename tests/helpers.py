"""Helpers for the integration tests: run the demo flow, read stored state, wait on it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ft_train
from deployments import demo
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore

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


def needs(what: str, why_missing: str | None) -> None:
    """A test that needs a system program (PostgreSQL, Chromium, ...): skipped where it is
    missing (`why_missing`, naming the install), except under CI (`CI` set), which installs
    everything the tests need (`.ci/run`): there a missing one fails the test."""
    if why_missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what}: {why_missing}; CI installs it (.ci/run), so this is a failure there")
    pytest.skip(f"{what}: {why_missing}")
