"""Hands-off driver recovery: the time from a driver's death to the first step its rerun
completes after resuming, through a deployment, `prefect server start` on loopback, a process
worker and `ft-train automations install`. Not part of the pytest run.

    python -m bench.recovery                   # both paths, once each
    python -m bench.recovery --path reactive --repeat 3

- reactive: the flow-run process is SIGKILLed (the OOM killer); the worker reports the flow run
  Crashed, the rerun automation starts a new one.
- heartbeat: the worker, the flow-run process and its Dask processes are SIGKILLed together (the
  machine is gone; nothing reports the crash); a new worker is started at once (the machine that
  replaces it). The zombie automation marks the flow run Crashed `--within` seconds after its last
  heartbeat (PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30, prefect.yaml), then the rerun automation.

The run trains `train_loop` below (one rank, 0.1 s a step, a checkpoint every 10 steps); the kill
comes once the checkpoint of step 10 is committed. The resumed rank writes the wall-clock time
of its first completed step to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
POOL = "ft-train-process"


def train_loop(config: dict) -> None:
    """A rank: `steps` steps of `step_s` each, a checkpoint every `every`; after a restore, the
    time of the first step is written to `resumed_file`."""
    import tempfile as tmp

    import ft_train

    step, resumed = 0, False
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            step, resumed = int(Path(d, "step").read_text()), True
    while step < config["steps"]:
        time.sleep(config["step_s"])
        step += 1
        with tmp.TemporaryDirectory() as d:
            attached = None
            if step % config["every"] == 0:
                Path(d, "step").write_text(str(step))
                attached = ft_train.Checkpoint.from_directory(d)
            ft_train.report({"step": step}, checkpoint=attached)
        if resumed:
            Path(config["resumed_file"]).write_text(json.dumps({"t": time.time(), "step": step}))
            resumed = False


def _start(args: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant at once, as a machine that is gone."""
    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(family, timeout=10)


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")


def _cli(args: list[str], env: dict) -> str:
    done = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


class Setup:
    """The server, the pool, the `demo` deployment, the automations and a worker."""

    def __init__(self, work: Path, within_s: float):
        self.work, self.procs = work, []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(work / "prefect"),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }
        server = ["server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
        self.procs.append(_start(PREFECT + server, self.env, work, work / "server.log"))
        _wait(self._healthy, 180, "the Prefect server")
        _cli(PREFECT + ["work-pool", "create", POOL, "--type", "process"], self.env)
        _cli(PREFECT + ["--no-prompt", "deploy", "-n", "demo"], self.env)
        install = [sys.executable, "-m", "cli", "automations", "install"]
        _cli([*install, "--deployment", "ft-train/demo", "--within", f"{within_s:g}"], self.env)
        self.worker = self.start_worker()

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self) -> subprocess.Popen:
        env = {**self.env, "PREFECT_WORKER_QUERY_SECONDS": "1"}
        log = self.work / f"worker-{len(self.procs)}.log"
        worker = _start(PREFECT + ["worker", "start", "--pool", POOL], env, self.work, log)
        self.procs.append(worker)
        return worker

    def close(self) -> None:
        for proc in reversed(self.procs):
            _kill_tree(proc.pid)


def measure(setup: Setup, path: str, index: int) -> dict:
    """One run killed after its checkpoint at step 10; the seconds from the kill to its rerun's
    first step, and to the rerun's flow run's creation."""
    from ft_train.driver.lease import read_lease
    from ft_train.storage.fs import Storage
    from ft_train.storage.run_state import RunStore

    runs, name = setup.work / "runs", f"{path}-{index}-{os.getpid()}"
    resumed_file = setup.work / f"{name}.resumed"
    parameters = {
        "train_loop": "bench.recovery:train_loop",
        "train_loop_config": {
            "steps": 600,
            "step_s": 0.1,
            "every": 10,
            "resumed_file": str(resumed_file),
        },
        "run_config": {"name": name, "storage_path": str(runs)},
        "scaling_config": {"num_workers": 1},
        "cluster": {"preload": []},
    }
    args = ["deployment", "run", "ft-train/demo"]
    for key, value in parameters.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    first = re.search(r"UUID: ([0-9a-f-]{36})", _cli(PREFECT + args, setup.env)).group(1)
    storage = Storage(str(runs))

    def checkpointed() -> bool:
        state = RunStore(storage, name).load()
        return state is not None and state.report_index >= 10

    _wait(checkpointed, 300, "the checkpoint of step 10")
    driver = read_lease(storage, name).pid
    killed = time.time()
    if path == "reactive":
        os.kill(driver, signal.SIGKILL)
    else:
        _kill_tree(setup.worker.pid)  # the worker and, below it, the flow run and its ranks
        _kill_tree(driver)  # in case it is not below the worker
        setup.worker = setup.start_worker()
    _wait(resumed_file.exists, 600, "the rerun's first step")
    resumed = json.loads(resumed_file.read_text())

    def rerun() -> dict | None:
        body = {"flow_runs": {"name": {"any_": [name]}}, "sort": "EXPECTED_START_TIME_ASC"}
        found = httpx.post(f"{setup.api}/flow_runs/filter", json=body, timeout=10).json()
        later = [r for r in found if r["id"] != first]
        return later[0] if later else None

    found = _wait(rerun, 60, "the rerun's flow run")
    crashed = httpx.get(f"{setup.api}/flow_runs/{first}", timeout=10).json()["end_time"]

    def since_kill(iso: str) -> float:
        return round(datetime.fromisoformat(iso).timestamp() - killed, 1)

    return {  # the first three: where the time went
        "path": path,
        "kill_to_crashed_s": since_kill(crashed),
        "kill_to_rerun_created_s": since_kill(found["created"]),
        "kill_to_rerun_running_s": since_kill(found["start_time"]),
        "kill_to_first_resumed_step_s": round(resumed["t"] - killed, 1),
        "resumed_at_step": resumed["step"],
        "load_average_1m": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=["reactive", "heartbeat", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--within", type=float, default=90.0, help="the zombie automation's")
    args = parser.parse_args(argv)
    paths = ["reactive", "heartbeat"] if args.path == "both" else [args.path]
    with tempfile.TemporaryDirectory(prefix="ft-bench-recovery-") as tmp:
        setup = Setup(Path(tmp), args.within)
        try:
            for path in paths:
                for i in range(args.repeat):
                    print(json.dumps(measure(setup, path, i)), flush=True)
        finally:
            setup.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
