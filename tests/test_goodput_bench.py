"""`python -m bench.goodput`'s machinery, so that it cannot rot: the figures it draws from an
event log, the loop's control files, and the injector against real processes (bench/README.md
has the figures of a full run)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil
import pytest

from bench import goodput
from bench.workload import Api, Events, read_events, run_loop
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)


class _OneRank(Api):
    """The loop on one process, without a framework."""

    system = "test"

    def rank(self) -> int:
        return 0

    def prepare_model(self, model):
        return model

    @contextlib.contextmanager
    def checkpoint_dir(self):
        yield None

    def report(self, metrics, checkpoint_dir, mode) -> None:
        pass


def test_the_loop_stops_at_the_harness_step_and_raises_once_when_told(tmp_path):
    control, events = tmp_path / "control", str(tmp_path / "events.jsonl")
    control.mkdir()
    config = {"steps": 10**9, "events": events, "control": str(control), "report_every": 0}
    (control / "stop").write_text("4")
    run_loop(config, _OneRank())
    assert [e["step"] for e in read_events(events) if e["event"] == "step"] == [1, 2, 3, 4]

    (control / "raise-0").touch()
    with pytest.raises(RuntimeError, match="injected exception on rank 0 before step 1"):
        run_loop(config, _OneRank())
    assert not (control / "raise-0").exists()  # once
    assert read_events(events)[-1]["event"] == "raise"


def test_the_injector_kills_waits_for_the_restart_then_raises_and_stops(tmp_path):
    control, path = tmp_path / "control", str(tmp_path / "events.jsonl")
    control.mkdir()
    cfg = {"events": path, "control": str(control)}
    p = {"duration_s": 1.5, "fault_every_s": 0.2, "kinds": ("kill", "raise")}
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    log = [Events(path, "test", r) for r in range(2)]
    try:
        with goodput.Injector(cfg, p, replace_node=lambda: None) as injector:
            t1 = time.time()  # at most the injector's: when every rank had completed step 1
            for r in range(2):
                log[r].emit("start", pid=ranks[r].pid)
                log[r].emit("step", step=1)
            # fault 0: rank 1's process SIGKILLed once the first fault is due
            assert ranks[1].wait(timeout=10) == -9
            assert ranks[0].poll() is None
            # no fault while the group restarts, though the next falls due at t1 + 0.4
            wait_for(lambda: time.time() > t1 + 0.6, 5, "the second fault's time to pass")
            assert len(injector.faults) == 1
            for r in range(2):
                log[r].emit("start", pid=ranks[0].pid)
            restarted = time.time()
            for step in range(2, 6):
                for r in range(2):
                    log[r].emit("step", step=step)
            # fault 1: rank 0 told to raise, once the group trains again
            wait_for((control / "raise-0").exists, 10, "rank 0's raise file")
            wait_for((control / "stop").exists, 10, "the stop file")
            stop = int((control / "stop").read_text())
        kinds = [(f["kind"], f["rank"]) for f in injector.faults]
        assert kinds == [("kill", 1), ("raise", 0)]
        assert injector.faults[0]["t"] >= t1 + 0.2 and injector.faults[1]["t"] > restarted
        assert 5 + 3 <= stop <= 5 + 3 + 5  # past the last step, by at most a second's steps
    finally:
        for proc in ranks:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for e in log:
            if e.fd is not None:
                os.close(e.fd)


NODE = """
import multiprocessing, time
if __name__ == "__main__":
    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped
    except psutil.NoSuchProcess:
        return True


def test_a_node_fault_kills_the_nanny_its_fork_server_and_the_rank(tmp_path):
    # A Dask nanny's worker forks from the nanny's fork server: the rank's parent is the server.
    # Killing the server alone would leave the nanny to start another server and worker.
    control, path = tmp_path / "control", str(tmp_path / "events.jsonl")
    control.mkdir()
    cfg = {"events": path, "control": str(control)}
    nanny = subprocess.Popen([sys.executable, "-c", NODE], stdout=subprocess.PIPE, text=True)
    rank = int(nanny.stdout.readline())  # type: ignore[union-attr]
    server = psutil.Process(rank).ppid()
    assert psutil.Process(server).ppid() == nanny.pid
    log, replaced = [Events(path, "test", r) for r in range(2)], []
    try:
        p = {"duration_s": 0.6, "fault_every_s": 0.2, "kinds": ("node",)}
        with goodput.Injector(cfg, p, replace_node=lambda: replaced.append(1)) as injector:
            for r, pid in enumerate([os.getpid(), rank]):  # the fault is rank 1's
                log[r].emit("start", pid=pid)
                log[r].emit("step", step=1)
            assert nanny.wait(timeout=10) == -9
            wait_for(lambda: _gone(server) and _gone(rank), 10, "the server and the rank to die")
        (fault,) = injector.faults
        assert fault["kind"] == "node" and "error" not in fault and replaced == [1]
    finally:
        nanny.kill()
        nanny.wait()
        for e in log:
            if e.fd is not None:
                os.close(e.fd)


def _group(pid: int) -> str:
    """The process's cgroup in the v1 cpu hierarchy."""
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line.split(":")[2].strip() for line in f if line.split(":")[1] == "cpu")


def test_a_new_node_starts_at_the_least_cpu_weight_until_it_is_idle():
    # It stands in for a node that starts on a machine of its own: busy 1.5 s, then idle.
    try:
        os.rmdir(probe := os.path.join(goodput.CGROUP_CPU, f"probe-{os.getpid()}"))
    except FileNotFoundError:
        pass
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        pytest.skip(f"no cgroup can be made in {goodput.CGROUP_CPU} here ({e!r})")
    busy = "import time\nt = time.time()\nwhile time.time() < t + 1.5: pass\ntime.sleep(30)"
    proc, record = goodput.start_node([sys.executable, "-c", busy])
    try:
        wait_for(lambda: _group(proc.pid) != "/", 5, "the node to join its group")
        group = os.path.join(goodput.CGROUP_CPU, _group(proc.pid).lstrip("/"))
        with open(os.path.join(group, "cpu.shares")) as f:
            assert int(f.read()) == goodput.LOW_SHARES
        wait_for(lambda: "low_weight_s" in record, 15, "the node to go back to the root group")
        assert _group(proc.pid) == "/" and not os.path.exists(group)
        assert 2 <= record["low_weight_s"] < 8
        # its CPU at that weight was counted; how much depends on the machine's load (at the
        # least weight it yields to every busy process: 0.76 s of its 1.5 s busy, beside a
        # second test process)
        assert record["cpu_s_at_low_weight"] > 0
    finally:
        proc.kill()
        proc.wait()


def test_with_partial_restarts_the_injector_waits_for_the_failed_rank_alone(tmp_path):
    # torchft: only the failed replica restarts; the survivor trains on and never starts again.
    # The next fault waits for the failed rank's restart and first step, not for the survivor's.
    control, path = tmp_path / "control", str(tmp_path / "events.jsonl")
    control.mkdir()
    cfg = {"events": path, "control": str(control)}
    p = {"duration_s": 1.5, "fault_every_s": 0.2, "kinds": ("kill", "raise")}
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    log = [Events(path, "test", r) for r in range(2)]
    try:
        injector = goodput.Injector(cfg, p, replace_node=lambda: None, partial_restart=True)
        with injector:
            for r in range(2):
                log[r].emit("start", pid=ranks[r].pid)
                log[r].emit("step", step=1)
            assert ranks[1].wait(timeout=10) == -9  # fault 0: rank 1 killed
            log[0].emit("step", step=2)  # the survivor trains on alone
            wait_for(lambda: time.time() > injector.faults[0]["t"] + 0.5, 5, "0.5 s to pass")
            assert len(injector.faults) == 1  # rank 1 has not come back: no fault meanwhile
            log[1].emit("start", pid=ranks[0].pid)
            back = time.time()
            for r in range(2):
                log[r].emit("step", step=3)
            # fault 1: rank 0 told to raise, though rank 0 never restarted
            wait_for((control / "raise-0").exists, 10, "rank 0's raise file")
        assert [(f["kind"], f["rank"]) for f in injector.faults] == [("kill", 1), ("raise", 0)]
        assert injector.faults[1]["t"] > back
    finally:
        for proc in ranks:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for e in log:
            if e.fd is not None:
                os.close(e.fd)
