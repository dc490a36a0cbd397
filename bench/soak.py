"""Soak: one long training run (the digits demo, 2 CPU ranks, local storage) under a fault about
every `--every` seconds, of mixed kinds, then a fault-free run of the same training; prints the
figures (not part of CI; bench/README.md has them).

    .venv/bin/python bench/soak.py --out /tmp/ft-train-soak     # 20 min, a fault every 30 s

A fault-free calibration run measures the steps a second while the ranks train; the soak trains
`--minutes` of steps at that rate (whole epochs, rounded up), so that its wall time, recoveries
added, ends past `--minutes`. Fault i comes at step (i + 1) * every * rate, the last one at least
`every` before the end, in turn
- in a rank (ft_train.testing.faults, at (rank, step)): `raise`, `kill` (SIGKILL of the rank's own
  process), `hang` (found by the watchdog, hang_timeout_s=10);
- from outside, once the run's committed step reaches the fault's: SIGKILL of a rank's Dask
  worker process (`worker_kill`), SIGTERM of one (`preemption`: a notice, then it leaves), and
  SIGKILL of the driver's whole process group, its local cluster with it, then the same flow run
  again, which resumes (`driver_kill`). The first `--driver-kills` outside faults are driver
  kills, so that one driver process lives from the first minutes to the end: the driver's
  figures are that process's, from its own `--flat-from` minute to the end.
Faults are placed by training progress, not by the clock: each lands while the ranks train (not
in a restart) and in-rank and outside faults stay interleaved. In wall time they come `every` s
plus the previous fault's recovery apart (the intervals are printed).

Checks, printed: every fault fired and the run finished; its final weights equal, bit for bit,
those of a fault-free run of the same config and steps (`reference`); the driver's RSS, open fds
and threads, the workers' RSS (every worker process of the cluster) and the disk under the run
(its storage, its temporary files, its journal in /dev/shm), sampled every 5 s (`samples.jsonl`),
grow less than 10 % from `--flat-from` (the driver's: from its own) to the end (the median of the
window's first minute against that of its last minute). Also sampled: how many reports the ranks
are ahead of what the driver has committed (`lag`: a driver that does not keep up queues them).

A checkpoint every `--checkpoint-every` steps (100: one or two a second here). Each checkpoint
is a Prefect task run, and the flow run keeps a few kB per task run until it ends (Prefect's
bookkeeping; bench/README.md, Soak): at 20 steps (5 to 10 task runs a second) that alone grows
the driver by 1 to 3 MB a minute.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
IN_RANK = ("raise", "kill", "hang")
OUTSIDE = ("worker_kill", "preemption")  # after the driver kills
CONFIG = {"batch_size": 8, "seed": 0}
STEPS_PER_EPOCH = math.ceil(1500 / 2 / CONFIG["batch_size"])  # digits.N_TRAIN over 2 ranks
TARGET = 0.10  # growth from --flat-from to the end
SAMPLE_EVERY_S = 5.0


def drive(args: dict) -> None:
    """The driver process: the demo flow with the soak's settings."""
    sys.path.insert(0, str(REPO))
    import ft_train
    from deployments import demo
    from flows.train import train

    if args.get("tracemalloc"):
        _trace(Path(args["tracemalloc"]))
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


def _trace(path: Path) -> None:
    """A leak hunt (`--tracemalloc`): from the driver's 2nd minute, tracemalloc traces what it
    allocates (slower then); every minute, the allocations since then still alive, largest first."""
    import threading
    import tracemalloc

    def loop() -> None:
        time.sleep(60)  # the start's allocations are not the leak
        tracemalloc.start(6)
        while True:
            time.sleep(60)
            stats = tracemalloc.take_snapshot().statistics("traceback")
            with open(path, "a") as f:
                traced = tracemalloc.get_traced_memory()[0] / 1e6
                f.write(f"=== {time.strftime('%H:%M:%S')}: {traced:.1f} MB traced\n")
                for s in stats[:8]:
                    f.write(f"{s.size / 1e6:.2f} MB, {s.count} blocks\n")
                    f.write("\n".join(s.traceback.format()) + "\n")

    threading.Thread(target=loop, daemon=True).start()


def start(args: dict, log: Path, out: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(
            [sys.executable, __file__, "--drive", json.dumps(args)],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the driver and its local cluster
            env={**os.environ, "TMPDIR": str(out / "tmp")},  # the run's temporary files
        )


def stop(driver: subprocess.Popen) -> None:
    """The driver's process group, where the soak ends before it (Ctrl+C, an error)."""
    if driver.poll() is None:
        os.killpg(driver.pid, signal.SIGKILL)


def run(args: dict, log: Path, out: Path) -> None:
    driver = start(args, log, out)
    try:
        driver.wait()
    finally:
        stop(driver)


def calibrate(out: Path, checkpoint_every: int) -> float:
    """Steps a second of a fault-free run of 20 epochs while its ranks train: from its metric
    history's first point to its last (the driver's and the ranks' start are not training)."""
    storage = out / "calibrate"
    config = {**CONFIG, "checkpoint_every": checkpoint_every, "epochs": 20}
    args = {"config": config, "name": "cal", "storage": str(storage)}
    run(args, out / "calibrate.log", out)
    points = json.loads((storage / "cal" / "metrics_history.json").read_text())["points"]
    first, last = points[0], points[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


@dataclass
class Fault:
    step: int
    kind: str
    rank: int
    marker: str = ""  # an in-rank fault's: created when it fires
    fired_at: float | None = None  # wall time
    what: str = ""


def schedule(rate: float, minutes: float, every: float, driver_kills: int, out: Path) -> list:
    faults, rng, t = [], random.Random(0), every
    while t <= minutes * 60 - every:
        i = len(faults)
        if i % 2 == 0:
            kind = IN_RANK[(i // 2) % len(IN_RANK)]
        elif i // 2 < driver_kills:
            kind = "driver_kill"
        else:
            kind = OUTSIDE[(i // 2 - driver_kills) % len(OUTSIDE)]
        marker = str(out / f"fault-{i}") if kind in IN_RANK else ""
        faults.append(Fault(int(t * rate), kind, rng.randint(0, 1), marker))
        t += every
    return faults


def run_state(storage: Path, name: str) -> dict:
    try:
        return json.loads((storage / name / "run_state.json").read_text())
    except (OSError, ValueError):
        return {"status": "none", "report_index": 0}  # not written yet


def soak(out: Path, config: dict, faults: list[Fault], trace: bool = False) -> dict:
    in_rank = [asdict(f) for f in faults if f.marker]
    args = {"config": {**config, "faults": in_rank}, "name": "soak", "storage": str(out / "runs")}
    if trace:
        args["tracemalloc"] = str(out / "tracemalloc.txt")
    outside = [f for f in faults if not f.marker]
    log, samples, starts = out / "soak.log", [], [time.time()]
    driver, next_sample = start(args, log, out), time.time()
    try:
        while True:
            if driver.poll() is not None:
                if run_state(out / "runs", "soak")["status"] == "finished":
                    break
                if len(starts) > sum(f.kind == "driver_kill" for f in faults) + 2:
                    raise SystemExit(f"the driver keeps ending, not killed by the soak: see {log}")
                driver = start(args, log, out)  # a killed driver: the next flow run resumes
                starts.append(time.time())
            if outside and run_state(out / "runs", "soak")["report_index"] >= outside[0].step:
                fire(outside.pop(0), driver.pid)
            if time.time() >= next_sample:
                next_sample += SAMPLE_EVERY_S
                if row := sample(driver.pid, out):
                    samples.append(row)
                    with open(out / "samples.jsonl", "a") as f:  # as it goes: a cut run keeps them
                        f.write(json.dumps(row) + "\n")
            time.sleep(1)
    finally:
        stop(driver)
    for f in faults:
        if f.marker and os.path.exists(f.marker):
            f.fired_at, f.what = os.stat(f.marker).st_mtime, f"{f.kind} on rank {f.rank}"
    return {"t0": starts[0], "end": time.time(), "driver_starts": starts, "samples": samples}


def fire(fault: Fault, driver_pid: int) -> None:
    fault.fired_at = time.time()
    if fault.kind == "driver_kill":
        os.killpg(driver_pid, signal.SIGKILL)
        fault.what = f"SIGKILL of the driver's process group {driver_pid}"
        return
    try:
        ranks = busy(workers(psutil.Process(driver_pid)))
    except psutil.Error:
        ranks = []  # the driver just ended
    if not ranks:
        fault.what = "no rank's worker found"
        return
    victim = ranks[fault.rank % len(ranks)]
    victim.send_signal(signal.SIGKILL if fault.kind == "worker_kill" else signal.SIGTERM)
    fault.what = f"{fault.kind} of worker {victim.pid}"


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


def busy(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The two that used the most CPU over half a second: the ranks', not the spare's."""

    def cpu(p: psutil.Process) -> float:
        try:
            return sum(p.cpu_times()[:2])
        except psutil.Error:
            return -1e9

    before = {p.pid: cpu(p) for p in procs}
    time.sleep(0.5)
    ranked = sorted(procs, key=lambda p: cpu(p) - before[p.pid], reverse=True)
    return sorted(ranked[:2], key=lambda p: p.pid)


def sample(driver_pid: int, out: Path) -> dict:
    try:
        driver = psutil.Process(driver_pid)
        with driver.oneshot():
            row = {
                "t": time.time(),
                "driver_pid": driver.pid,
                "driver_rss": driver.memory_info().rss,
                "driver_fds": driver.num_fds(),
                "driver_threads": driver.num_threads(),
            }
        procs = workers(driver)
    except psutil.Error:
        return {}  # the driver just ended
    rss = 0
    for w in procs:
        try:
            rss += w.memory_info().rss
        except psutil.Error:
            continue
    return {**row, "workers_rss": rss, "workers": len(procs), "disk": disk(out), "lag": lag(out)}


def journal(out: Path) -> Path:
    """The soak run's journals (`ft_train.worker.journal`): a folder per attempt."""
    sys.path.insert(0, str(REPO))
    from ft_train.storage.fs import Storage
    from ft_train.worker.journal import journal_root, run_key

    return Path(journal_root()) / run_key(Storage(str(out / "runs")).uri("soak"))


def disk(out: Path) -> int:
    """Bytes under the run: its storage, its temporary files (the ranks' checkpoint directories,
    the download cache), its journal."""
    total = 0
    for root in (out / "runs", out / "tmp", journal(out)):
        for folder, _, files in os.walk(root):  # a folder removed meanwhile is passed by
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except OSError:
                    continue  # removed meanwhile
    return total


def lag(out: Path) -> int:
    """How far the ranks are ahead of the driver: the newest report a rank has made (its
    journal's index) less the newest one the driver has committed (a driver that does not keep
    up queues the reports it has not handled)."""
    made = 0
    for path in journal(out).glob("*/rank-*.index"):
        try:
            made = max(made, struct.unpack("<q", path.read_bytes())[0])
        except (OSError, struct.error):
            continue  # removed meanwhile, or not written yet
    return max(0, made - run_state(out / "runs", "soak")["report_index"])


def compare(out: Path) -> dict:
    """The soak's final weights against the reference's: bit for bit, and the largest difference."""
    import torch

    sys.path.insert(0, str(REPO))
    import ft_train

    weights = []
    for name in ("runs/soak", "reference/reference"):
        root, run = name.split("/")
        result = ft_train.TrainResult.from_path(str(out / root), run)
        with result.checkpoint.as_directory() as d:
            weights.append(torch.load(os.path.join(d, "train_state.pt"), weights_only=False))
    a, b = (w["model"] for w in weights)
    same_keys = a.keys() == b.keys()
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in a if same_keys]
    return {
        "equal": same_keys and all(torch.equal(a[k], b[k]) for k in a),
        "max_abs_diff": max(diffs) if same_keys else None,
        "steps": [w["step"] for w in weights],
    }


def growth(samples: list[dict], key: str, since: float) -> dict | None:
    """`key` in the window from `since` to the end: the median of its first minute and of its
    last, and the growth from one to the other."""
    rows = [r for r in samples if r["t"] >= since]
    if len(rows) < 4 or rows[-1]["t"] - rows[0]["t"] < 120:
        return None  # too short a window to tell
    first = statistics.median(r[key] for r in rows if r["t"] < rows[0]["t"] + 60)
    last = statistics.median(r[key] for r in rows if r["t"] > rows[-1]["t"] - 60)
    change = last / first - 1 if first else math.inf
    return {
        "first": first,
        "last": last,
        "growth_pct": round(100 * change, 1),
        "ok": change < TARGET,
    }


def figures(record: dict, faults: list[Fault], flat_from_s: float, out: Path) -> dict:
    samples, since = record["samples"], record["t0"] + flat_from_s
    last_driver = samples[-1]["driver_pid"]
    # the last driver from its own `flat_from` on: a driver's first minutes fill Dask's bounded
    # logs (bench/README.md, Soak), and that driver starts a few minutes into the run
    driver_since = max(since, record["driver_starts"][-1] + flat_from_s)
    driver_rows = [r for r in samples if r["driver_pid"] == last_driver]
    keys = ("driver_rss", "driver_fds", "driver_threads")
    flat = {k: growth(driver_rows, k, driver_since) for k in keys}
    flat.update({k: growth(samples, k, since) for k in ("workers_rss", "disk")})
    fired = sorted(f.fired_at for f in faults if f.fired_at is not None)
    gaps = [b - a for a, b in zip(fired, fired[1:])]
    state = run_state(out / "runs", "soak")
    return {
        "wall_min": round((record["end"] - record["t0"]) / 60, 1),
        "faults_planned": dict(collections.Counter(f.kind for f in faults)),
        "faults_fired": len(fired),
        "fault_interval_s": {
            "mean": round(statistics.mean(gaps), 1) if gaps else None,
            "max": round(max(gaps), 1) if gaps else None,
        },
        "failures_recorded": dict(collections.Counter(f["kind"] for f in state["failures"])),
        "status": state["status"],
        "driver_runs": len(record["driver_starts"]),
        "driver_lag_steps": {  # reports made by the ranks, not yet handled by the driver
            "median": statistics.median(r["lag"] for r in samples),
            "max": max(r["lag"] for r in samples),
        },
        "flat_window_from_min": {
            "driver": round((driver_since - record["t0"]) / 60, 1),
            "others": flat_from_s / 60,
        },
        "growth": flat,
    }


def main() -> None:
    if sys.argv[1:2] == ["--drive"]:
        return drive(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="of training, at least")
    parser.add_argument("--every", type=float, default=30.0, help="s of training between faults")
    parser.add_argument("--driver-kills", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps")
    parser.add_argument("--flat-from", type=float, default=5.0, help="minute the window starts")
    parser.add_argument("--out", type=Path, default=Path("/tmp/ft-train-soak"))
    parser.add_argument("--tracemalloc", action="store_true", help="the driver's top growth")
    a = parser.parse_args()
    # SIGTERM as Ctrl+C: the driver's process group is then killed too (`stop`)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    (a.out / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(a.out / "prefect"))
    rate = calibrate(a.out, a.checkpoint_every)
    epochs = math.ceil(a.minutes * 60 * rate / STEPS_PER_EPOCH)
    config = {**CONFIG, "checkpoint_every": a.checkpoint_every, "epochs": epochs}
    faults = schedule(rate, a.minutes, a.every, a.driver_kills, a.out)
    print(f"{rate:.1f} steps/s: {epochs} epochs, {len(faults)} faults", flush=True)
    record = soak(a.out, config, faults, a.tracemalloc)
    if a.tracemalloc:
        return  # a slowed driver: no figures
    report = figures(record, faults, a.flat_from * 60, a.out)
    began = time.time()
    reference = {"config": config, "name": "reference", "storage": str(a.out / "reference")}
    run(reference, a.out / "reference.log", a.out)
    report["reference_wall_min"] = round((time.time() - began) / 60, 1)
    report["same_weights"] = compare(a.out)
    report.update(steps_per_s=round(rate, 1), epochs=epochs)
    report["verdict"] = {
        f"lasted {a.minutes:g} min or more": report["wall_min"] >= a.minutes,
        "every fault fired, the run finished": report["faults_fired"] == len(faults)
        and report["status"] == "finished",
        "same weights as the fault-free run": report["same_weights"]["equal"],
        "flat (growth < 10 %)": all(g is not None and g["ok"] for g in report["growth"].values()),
    }
    report["faults"] = [asdict(f) for f in faults]
    (a.out / "report.json").write_text(json.dumps(report, indent=1))
    report.pop("faults")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
