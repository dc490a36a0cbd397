"""One driver per run: the lease on storage (`ft_train.driver.lease`), on a local path and on S3.

The processes that hold a lease here are real ones: this test process, and a driver process
killed with SIGKILL. A holder "on another machine" is a lease document naming another machine,
as such a driver writes it; the storage under it is the real one."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from cli import main as cli
from ft_train.driver.lease import LEASE_FILE, LeaseDoc, RunLease
from ft_train.errors import RunLockedError
from ft_train.storage.run_state import STATE_FILE, RunState, RunStore
from tests.conftest import on_storage
from tests.helpers import foreign_lease, fresh, prepare_noop, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_lease(target, name: str) -> LeaseDoc:
    return LeaseDoc.model_validate_json(fresh(target).read_bytes(f"{name}/{LEASE_FILE}"))


def status(target, name: str) -> str:
    """What `ft-train status` prints for run `name`."""
    options = [f"--storage-option={k}={v}" for k, v in target.options.items()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["status", name, "--storage-path", target.path, *options]) == 0
    return out.getvalue()


def demo(target, name: str) -> subprocess.CompletedProcess:
    """`ft-train demo` for run `name`, as a user starts it."""
    options = [f"--storage-option={k}={v}" for k, v in target.options.items()]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "demo",
            "--name",
            name,
            "--storage-path",
            target.path,
            *options,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def holds(lease: RunLease) -> bool:
    try:
        lease.check()
    except RunLockedError:
        return False
    return True


def test_a_second_driver_is_refused_while_the_first_holds_the_run(storage):
    first = prepare_noop(storage, "run", holder="flow run 'first'")
    state_file = f"run/{STATE_FILE}"
    before = fresh(storage).read_bytes(state_file)
    with pytest.raises(RunLockedError, match=f"flow run 'first', pid {os.getpid()}") as err:
        prepare_noop(storage, "run")
    assert "run_config.name" in str(err.value)  # the way out is named
    assert fresh(storage).read_bytes(state_file) == before  # no driver_crash recorded
    first.release()
    second = prepare_noop(storage, "run")  # released: the next driver starts at once
    assert second.state.driver_runs == 2
    assert [f.kind for f in second.state.failures] == []  # the first ended; it did not crash
    second.release()
    assert read_lease(storage, "run").released


def test_a_lease_left_by_a_killed_driver_on_this_machine_is_taken_at_once(storage, tmp_path):
    script = (
        "import sys, ft_train\n"
        "from ft_train.driver import prepare\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "prepare.prepare_run('tests.helpers:noop_train_loop', {}, ft_train.ScalingConfig(),\n"
        f"    ft_train.RunConfig(name='run', storage_path={storage.path!r},\n"
        f"                       storage_options={storage.options!r}), log=lambda m: None)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid} "):
            prepare_noop(storage, "run")
        assert re.search(
            rf"driver +pid {holder.pid} on .*: training it now", status(storage, "run")
        )
        refused = demo(storage, "run")  # at once: no Prefect server, no cluster started for it
        assert refused.returncode == 1, refused.stderr
        assert re.search(
            rf"another driver \(pid {holder.pid} on .*use another --name", refused.stderr
        )
        holder.send_signal(signal.SIGKILL)  # no release, no end recorded
        # not reaped yet (its parent is busy elsewhere): a zombie is gone all the same
        wait_for(
            lambda: psutil.Process(holder.pid).status() == psutil.STATUS_ZOMBIE,
            10,
            "the killed driver to become a zombie",
        )
        assert re.search(r"driver +pid .*: gone without an end", status(storage, "run"))
        plan = prepare_noop(storage, "run")
    finally:
        holder.kill()
        holder.wait(10)
    assert [f.kind for f in plan.state.failures] == ["driver_crash"]
    assert read_lease(storage, "run").pid == os.getpid()
    plan.release()


def test_a_lease_held_on_another_machine_is_refused_while_it_is_renewed(storage):
    name, ttl = "renewed", 3.0
    foreign_lease(storage, name, ttl)
    stop = threading.Event()

    def renew():  # the other machine's driver, renewing as a live one does
        for n in range(1, 100):
            if stop.wait(ttl / 6):
                return
            foreign_lease(storage, name, ttl, renewals=n)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(RunLockedError, match="pid 4242 on node-7"):
            prepare_noop(storage, name)
    finally:
        stop.set()
        renewer.join()
    assert fresh(storage).read_bytes(f"{name}/{STATE_FILE}") is None  # nothing written


def test_a_lease_on_another_machine_is_taken_once_it_goes_a_ttl_unrenewed(storage):
    foreign_lease(storage, "stale", ttl_s=1.5)
    plan = prepare_noop(storage, "stale")  # waits for one ttl without a renewal
    assert read_lease(storage, "stale").pid == os.getpid()
    plan.release()
    # One last renewed long ago (more than two ttls by this clock) is taken without a wait.
    foreign_lease(storage, "long-gone", ttl_s=600.0, age_s=1300.0)
    plan = prepare_noop(storage, "long-gone")
    plan.release()


@on_storage("s3")
def test_s3_conditional_writes_refuse_a_stale_version(storage):
    store = fresh(storage)
    first = store.write_if("cas/doc", b"one", None)
    assert first and store.write_if("cas/doc", b"two", None) is None  # it exists
    assert store.read_versioned("cas/doc") == (b"one", first)
    second = store.write_if("cas/doc", b"two", first)
    assert second and second != first
    assert store.write_if("cas/doc", b"three", first) is None  # a stale version
    assert store.write_if("cas/missing", b"x", first) is None
    assert store.read_versioned("cas/doc") == (b"two", second)


def test_a_driver_that_lost_its_lease_stops_writing_the_run_state(storage):
    storage_ = fresh(storage)
    store = RunStore(storage_, "taken")
    lease = RunLease(storage_, "taken", ttl_s=0.6)
    lease.acquire()
    store.lease = lease
    store.save(RunState(name="taken"))
    lost = threading.Event()
    reasons = []
    lease.on_lost = lambda why: (reasons.append(why), lost.set())
    foreign_lease(storage, "taken", ttl_s=30.0)  # another driver took the run over
    assert lost.wait(10), "the holder never noticed"
    assert "another driver took the run over" in reasons[0]
    before = storage_.read_bytes(store.path)
    with pytest.raises(RunLockedError, match="stopped training it"):
        store.save(RunState(name="taken", report_index=5))
    assert storage_.read_bytes(store.path) == before
    lease.release()  # a lost lease is not released: it is the other driver's
    assert read_lease(storage, "taken").owner == "elsewhere-owner"


@on_storage("local")
def test_a_holder_that_cannot_renew_for_a_ttl_counts_its_lease_lost(storage, tmp_path):
    lease = RunLease(fresh(storage), "cut-off", ttl_s=0.6)
    lease.acquire()
    lease.check()
    run_dir = os.path.join(storage.path, "cut-off")
    os.rename(run_dir, f"{run_dir}.away")
    open(run_dir, "w").close()  # a file where the run's directory was: renewals now fail
    try:
        wait_for(lambda: not holds(lease), 10, "the holder to give its lease up")
        with pytest.raises(RunLockedError, match="could not renew it"):
            lease.check()
    finally:
        os.remove(run_dir)
        os.rename(f"{run_dir}.away", run_dir)
        lease.release()
    assert not read_lease(storage, "cut-off").released  # lost: not this driver's to release
