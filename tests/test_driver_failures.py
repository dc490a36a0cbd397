"""Job driver failures: the flow process dies (SIGKILL of it and its local cluster) or is stopped
with Ctrl+C; a new flow run with the same (storage_path, name) resumes from the latest committed
checkpoint, without charging max_failures, and ends bit-identical to an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest

from ft_train.driver.lease import LEASE_FILE, LeaseDoc
from ft_train.errors import RunLockedError
from ft_train.storage.run_state import STATE_FILE, now
from tests.conftest import StorageTarget, on_storage
from tests.helpers import (
    assert_bit_identical,
    demo_config,
    final_weights,
    fresh,
    load_state,
    train_demo,
    wait_for,
)

REPO = str(Path(__file__).resolve().parents[1])


def start_driver(storage, name, config, api_url, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, PREFECT_API_URL=api_url, PYTHONPATH=REPO)
    args = dict(
        repo=REPO,
        name=name,
        config=config,
        storage_path=storage.path,
        storage_options=storage.options,
    )
    log = open(tmp_path / f"driver-{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, str(Path(REPO) / "tests" / "driver_script.py"), json.dumps(args)],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the driver and its local Dask cluster
    )


def wait_exit(driver: subprocess.Popen, timeout_s: float, log: Path) -> int:
    """The driver's exit code; if it does not exit in time, fail with its threads' stacks."""
    try:
        return driver.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        driver.send_signal(signal.SIGUSR1)  # driver_script dumps every thread's stack
        time.sleep(2)
        raise AssertionError(
            f"the driver did not exit {timeout_s:g}s after the signal; the end of its log:\n"
            + log.read_text(errors="replace")[-12000:]
        ) from None


@pytest.fixture(scope="module")
def reference_weights(prefect_api, tmp_path_factory):
    """The final weights of an uninterrupted run of the same training (computed once)."""
    storage = StorageTarget("local", str(tmp_path_factory.mktemp("reference")))
    return final_weights(
        train_demo(storage, "reference", demo_config(epochs=2, checkpoint_every=5))
    )


@pytest.mark.parametrize(
    "storage, sig",
    [("s3", signal.SIGKILL), ("local", signal.SIGINT)],
    ids=["s3-sigkill", "local-ctrl-c"],
    indirect=["storage"],
)
def test_driver_killed_after_second_checkpoint_resumes_bit_identical(
    storage, tmp_path, prefect_api, reference_weights, sig
):
    # Rank 0 blocks right after the second checkpoint (step 10), once, so the driver dies there.
    hold = {"rank": 0, "step": 10, "kind": "wait", "marker": str(tmp_path / "hold")}
    config = demo_config([hold], epochs=2, checkpoint_every=5)
    driver = start_driver(storage, "victim", config, prefect_api, tmp_path)
    try:
        wait_for(
            lambda: (s := load_state(storage, "victim")) is not None and s.report_index == 10,
            timeout_s=240,
            what="the second checkpoint of the driver under test",
        )
        wait_for(lambda: os.path.exists(hold["marker"]), 60, "rank 0 to hold at step 10")
        # A second driver for the run (an overlapping scheduled run) is refused while this one
        # lives, and leaves the run state as it was.
        before = fresh(storage).read_bytes(f"victim/{STATE_FILE}")
        with pytest.raises(RunLockedError, match=f"pid {driver.pid} "):
            train_demo(storage, "victim", config)
        assert fresh(storage).read_bytes(f"victim/{STATE_FILE}") == before
        lease = fresh(storage).read_bytes(f"victim/{LEASE_FILE}")
        victim_run = LeaseDoc.model_validate_json(lease).holder_id  # its Prefect flow run
        os.killpg(driver.pid, sig)  # Ctrl+C in a terminal also signals the whole group
        assert wait_exit(driver, 120, tmp_path / "driver-victim.log") != 0
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    killed = load_state(storage, "victim")
    assert killed.status == ("running" if sig == signal.SIGKILL else "interrupted")
    assert killed.latest.startswith("checkpoint_000010-")

    if sig == signal.SIGKILL:  # a different name in the same place starts fresh
        other = train_demo(storage, "other", demo_config(epochs=1, checkpoint_every=5))
        assert load_state(storage, "other").attempts[0].restored_from is None
        assert other.failures == [] and other.last_metrics["resumed_from"] is None

    # The same name resumes from the second checkpoint; max_failures=0 is not spent by it.
    resumed = train_demo(storage, "victim", config, max_failures=0)
    state = load_state(storage, "victim")
    assert resumed.status == "finished"
    assert state.attempts[-1].restored_from == killed.latest
    assert resumed.last_metrics["resumed_from"] == 10
    kind = "driver_crash" if sig == signal.SIGKILL else "driver_interrupt"
    assert [(f.kind, f.charged) for f in resumed.failures] == [(kind, False)]
    if sig == signal.SIGKILL:  # nothing told Prefect that the killed driver's flow run ended
        assert flow_run_state(victim_run).is_crashed()
    assert_bit_identical(final_weights(resumed), reference_weights)


def flow_run_state(flow_run_id: str):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(flow_run_id)).state


def test_ctrl_c_ends_the_driver_while_a_worker_is_frozen(tmp_path, prefect_api):
    """A rank's process stops (SIGSTOP, as on a machine that hangs) and the user presses Ctrl+C:
    the driver records the interrupt and exits, although that worker never answers its kill."""
    storage = StorageTarget("local", str(tmp_path / "runs"))
    freeze = {"rank": 1, "step": 3, "kind": "freeze", "marker": str(tmp_path / "freeze")}
    driver = start_driver(storage, "frozen", demo_config([freeze]), prefect_api, tmp_path)
    try:
        wait_for(lambda: os.path.exists(freeze["marker"]), 240, "rank 1 to freeze at step 3")
        os.kill(driver.pid, signal.SIGINT)
        assert wait_exit(driver, 60, tmp_path / "driver-frozen.log") != 0
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert load_state(storage, "frozen").status == "interrupted"

    # The frozen worker goes too (the fork server it came from follows the driver out).
    def group() -> list[str]:
        return subprocess.run(
            ["pgrep", "-g", str(driver.pid)], capture_output=True, text=True
        ).stdout.split()

    try:
        wait_for(lambda: not group(), 15, "the driver's processes to exit")
    finally:
        subprocess.run(["pkill", "-KILL", "-g", str(driver.pid)])


def test_ctrl_c_while_prefect_creates_a_task_run_is_an_interrupt(
    tmp_path, prefect_api, monkeypatch
):
    """Ctrl+C that lands while Prefect creates a segment's task run: Prefect's crash handler
    then raises its own error in its place (ValueError: Task run is not set). The run is still
    recorded as interrupted, not failed, and the caller gets the KeyboardInterrupt (the CLI
    then says how to resume, without a traceback)."""
    import prefect.task_engine

    create = prefect.task_engine._create_task_run_locally

    def ctrl_c_in_train_task(*, task, **kw):
        if task.name == "train-until-checkpoint":
            raise KeyboardInterrupt  # where the signal handler would raise it
        return create(task=task, **kw)

    monkeypatch.setattr(prefect.task_engine, "_create_task_run_locally", ctrl_c_in_train_task)
    storage = StorageTarget("local", str(tmp_path / "runs"))
    with pytest.raises(KeyboardInterrupt):
        train_demo(storage, "interrupted", demo_config())
    state = load_state(storage, "interrupted")
    assert state.status == "interrupted"
    assert [(f.kind, f.charged) for f in state.failures] == [("driver_interrupt", False)]


@on_storage("local")
def test_a_driver_whose_run_another_driver_took_over_stops_without_writing(
    storage, tmp_path, prefect_api
):
    """Another driver takes the run's lease (as one on another machine does once this one has
    gone a ttl without renewing it): this driver notices at its next renewal, stops its ranks
    and exits with RunLockedError, and writes nothing more to the run."""
    hold = {"rank": 1, "step": 3, "kind": "wait", "marker": str(tmp_path / "hold")}
    driver = start_driver(storage, "taken", demo_config([hold]), prefect_api, tmp_path)
    log = tmp_path / "driver-taken.log"
    runs = fresh(storage)
    try:
        wait_for(lambda: os.path.exists(hold["marker"]), 240, "rank 1 to hold at step 3")
        thief = LeaseDoc(
            owner="thief",
            machine="another-machine",
            host="node-7",
            pid=4242,
            pid_started=1.0,
            ttl_s=30.0,
            acquired_at=now(),
            renewed_at=now(),
        )
        runs.write_atomic(f"taken/{LEASE_FILE}", thief.model_dump_json().encode())
        before = runs.read_bytes(f"taken/{STATE_FILE}")
        assert wait_exit(driver, 60, log) != 0
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert (
        "RunLockedError" in log.read_text()
        and "another driver took the run over" in log.read_text()
    )
    assert runs.read_bytes(f"taken/{STATE_FILE}") == before  # no failure, no status written
    assert LeaseDoc.model_validate_json(runs.read_bytes(f"taken/{LEASE_FILE}")).owner == "thief"
