"""Soak: one long training run (the digits demo, 2 CPU ranks, local storage) under a fault about
every `--every` seconds, of mixed kinds, then a fault-free run of the same config; prints the
figures (not part of CI; record them in bench/README.md).

    .venv/bin/python bench/soak.py --minutes 20 --every 30 --out /tmp/soak

Faults, in turn:
- in the ranks, at a (rank, step) the calibration puts `--every` s apart (ft_train.testing.faults):
  `raise` (an exception), `kill` (SIGKILL of the rank's process), `hang` (the watchdog's);
- from outside, at that time: SIGKILL of a Dask worker process of the driver's cluster (a rank's,
  or the spare's), SIGTERM of one (a preemption notice), SIGKILL of the driver's whole process
  group (its local cluster with it), then the same flow run again, which resumes.
Checks: the run finishes with every fault recovered; its final weights equal the fault-free
run's; the driver's and the workers' RSS, the disk use under the run's storage, the driver's open
fds and threads, sampled every 5 s, grow under 10 % from the 5th minute to the end (the driver's
within each of its lives: a rerun is a new process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
IN_RANK = ("raise", "kill", "hang")
OUTSIDE = ("worker_kill", "preemption", "driver_kill")


def drive(args: dict) -> None:
    """The driver process: the demo flow with the soak's settings."""
    sys.path.insert(0, str(REPO))
    import ft_train
    from deployments import demo
    from flows.train import train

    train(
        train_loop=demo.TRAIN_LOOP,
        train_loop_config=args["config"],
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=args["name"],
            storage_path=args["storage"],
            failure_config=ft_train.FailureConfig(max_failures=-1, hang_timeout_s=10.0),
            # two kept: the disk's figure is then what the run holds, not its history
            checkpoint_config=ft_train.CheckpointConfig(num_to_keep=2),
        ),
        cluster=ft_train.ClusterConfig(preload=list(demo.CLUSTER["preload"])),
    )


def start(args: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--drive", json.dumps(args)],
        cwd=REPO,
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the driver and its local cluster
    )


def workers(driver: psutil.Process) -> list[psutil.Process]:
    """The driver's Dask worker processes (children of its nannies, or forked for them)."""
    found = []
    for p in driver.children(recursive=True):
        try:
            command = " ".join(p.cmdline())
            if ("forkserver" in command or "spawn_main" in command) and not p.children():
                found.append(p)  # not the fork server itself, nor Prefect's server
        except psutil.Error:
            continue
    return found


def sample(driver: psutil.Process, storage: Path) -> dict:
    try:
        with driver.oneshot():
            row = {
                "t": time.time(),
                "driver_pid": driver.pid,
                "driver_rss": driver.memory_info().rss,
                "driver_fds": driver.num_fds(),
                "driver_threads": driver.num_threads(),
            }
    except psutil.Error:
        return {}
    rss = 0
    for w in workers(driver):
        try:
            rss += w.memory_info().rss
        except psutil.Error:
            continue
    disk = 0
    for root in (storage, Path(tempfile.gettempdir()) / "ft-train-cache"):
        for f in root.rglob("*"):
            try:
                disk += f.stat().st_size if f.is_file() else 0
            except OSError:
                continue  # removed meanwhile
    return {**row, "workers_rss": rss, "disk": disk}


def calibrate(out: Path, config: dict) -> float:
    """Steps a second of a fault-free run of a few epochs, while its ranks train (from its
    attempt's start to its last write: the driver's start is not training)."""
    from datetime import datetime

    storage = out / "calibrate"
    args = {"config": {**config, "epochs": 3}, "name": "cal", "storage": str(storage)}
    start(args, out / "calibrate.log").wait()
    state = json.loads((storage / "cal" / "run_state.json").read_text())
    began = datetime.fromisoformat(state["attempts"][0]["started_at"])
    ended = datetime.fromisoformat(state["updated_at"])
    return state["report_index"] / max((ended - began).total_seconds(), 1e-3)


def schedule(rate: float, minutes: float, every: float, out: Path) -> tuple[list, list]:
    """In-rank faults (config entries) and outside ones ((seconds from start, kind))."""
    in_rank, outside, rng = [], [], random.Random(0)
    for i, t in enumerate(range(int(every), int(minutes * 60), int(every))):
        kinds = IN_RANK if i % 2 == 0 else OUTSIDE
        kind = kinds[(i // 2) % len(kinds)]
        if kind in IN_RANK:
            marker = str(out / f"fault-{i}")
            in_rank.append(
                {"rank": rng.randint(0, 1), "step": int(t * rate), "kind": kind, "marker": marker}
            )
        else:
            outside.append((float(t), kind))
    return in_rank, outside


def soak(out: Path, minutes: float, every: float) -> dict:
    base = {"epochs": 1, "checkpoint_every": 20, "batch_size": 8, "seed": 0}
    rate = calibrate(out, base)
    steps_per_epoch = 1500 // (2 * base["batch_size"])
    epochs = max(1, int(minutes * 60 * rate / steps_per_epoch))
    config = {**base, "epochs": epochs}
    faults, outside = schedule(rate, minutes, every, out)
    args = {"config": {**config, "faults": faults}, "name": "soak", "storage": str(out / "runs")}
    log, samples, done = out / "soak.log", [], []
    driver = start(args, log)
    t0 = time.monotonic()
    while True:
        rc = driver.poll()
        if rc is not None:
            state = json.loads((out / "runs" / "soak" / "run_state.json").read_text())
            if state["status"] == "finished":
                break
            driver = start(args, log)  # a killed driver: the next flow run resumes
        now = time.monotonic() - t0
        try:
            process = psutil.Process(driver.pid)
            if outside and now >= outside[0][0]:
                _, kind = outside.pop(0)
                done.append((round(now), kind, _act(kind, process)))
            if row := sample(process, out / "runs"):
                samples.append(row)
                with open(out / "samples.jsonl", "a") as f:  # as it goes: a cut run keeps them
                    f.write(json.dumps(row) + "\n")
        except psutil.Error:
            pass  # the driver just ended: the next turn sees it
        time.sleep(5)
    wall = time.monotonic() - t0
    reference = {**args, "config": config, "name": "reference"}
    start(reference, out / "reference.log").wait()
    return {
        "wall_s": wall,
        "rate": rate,
        "epochs": epochs,
        "in_rank": faults,
        "outside": done,
        "samples": samples,
        "same_weights": _same(out / "runs", "soak", "reference"),
    }


def _act(kind: str, driver: psutil.Process) -> str:
    if kind == "driver_kill":
        os.killpg(driver.pid, signal.SIGKILL)
        return f"killed driver {driver.pid}"
    found = workers(driver)
    if not found:
        return "no worker"
    victim = random.Random(len(found)).choice(found)
    victim.send_signal(signal.SIGKILL if kind == "worker_kill" else signal.SIGTERM)
    return f"{kind} of worker {victim.pid}"


def _same(root: Path, a: str, b: str) -> bool:
    import torch

    sys.path.insert(0, str(REPO))
    import ft_train

    weights = []
    for name in (a, b):
        result = ft_train.TrainResult.from_path(str(root), name)
        with result.checkpoint.as_directory() as d:
            weights.append(torch.load(os.path.join(d, "train_state.pt"), weights_only=False))
    return all(
        torch.equal(weights[0]["model"][k], weights[1]["model"][k]) for k in weights[0]["model"]
    )


def growth(samples: list[dict], key: str, after_s: float) -> float:
    """The growth of `key` from the first minute after `after_s` to the last minute, in the
    last driver's life for the driver's figures."""
    t0 = samples[0]["t"]
    rows = [r for r in samples if r["t"] - t0 >= after_s]
    if key.startswith("driver"):
        rows = [r for r in rows if r["driver_pid"] == samples[-1]["driver_pid"]]
    if len(rows) < 4:
        return float("nan")
    first = statistics.median(r[key] for r in rows[:12])
    last = statistics.median(r[key] for r in rows[-12:])
    return last / first - 1


def main() -> None:
    if sys.argv[1:2] == ["--drive"]:
        return drive(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/ft-train-soak"))
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(a.out / "prefect"))
    figures = soak(a.out, a.minutes, a.every)
    keys = ("driver_rss", "workers_rss", "disk", "driver_fds", "driver_threads")
    report = {k: growth(figures["samples"], k, 300.0) for k in keys}
    state = json.loads((a.out / "runs" / "soak" / "run_state.json").read_text())
    kinds = [f["kind"] for f in state["failures"]]
    print(
        json.dumps(
            {
                "wall_s": round(figures["wall_s"]),
                "steps_per_s": round(figures["rate"], 1),
                "epochs": figures["epochs"],
                "faults_in_rank": len(figures["in_rank"]),
                "faults_outside": figures["outside"],
                "failures_recorded": kinds,
                "status": state["status"],
                "same_weights": figures["same_weights"],
                "growth_from_minute_5": report,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
