"""Goodput under failures: ft-train, Ray Train V2 and torchft on the bench workload, faults on a
timer, each judged against bare DDP measured in the same invocation.

    .venv-bench/bin/python -m bench.goodput [--minutes 10] [--fault-every 30 | 120]
        [--workload mlp | transformer] [--storage local | s3] [--systems ft-train,ray,torchft]
        [--ray-sweep 5,15,60] [--sweep-minutes 2] [--checkpoint-every 60]
        [--snapshot-every-s 5] [--off-minutes 5] [--fault-free-minutes 2]
    .venv-bench/bin/python -m bench.goodput --state-check     (the transformer's state, once)

One after the other, each in a fresh process (`bench.ddp_bare`, `bench.ft_side`,
`bench.ray_side`, `bench.torchft_side` goodput): bare DDP without faults, first and last; then
for each system a run without faults, checkpoints or snapshots; for Ray, its checkpoint interval
swept (`--ray-sweep`, seconds' worth of its fault-free steps, each run `--sweep-minutes` with the
faults; the best goodput's interval is used, and the sweep printed); the run with faults
(ft-train's with in-memory snapshots); a second run without faults; and for ft-train, a run with
faults and no snapshots (no just-in-time save either: storage only). All train
`bench.workload.run_loop` with 2 ranks (torchft: two replica groups of one rank) and checkpoint
to `--storage` every `--checkpoint-every` seconds' worth of their own fault-free steps
(asynchronous upload; torchft's rank saves synchronously, to local storage only). ft-train and
Ray run on a cluster with one spare node and `max_failures=-1`; torchft's groups each run under
torchrun, which restarts its rank (`bench/torchft_side.py` says how it is laid out).

Faults come from outside the ranks (`Injector`, a thread in the measuring process), one every
`--fault-every` seconds from the first step, in turn: SIGKILL of a rank's process, an exception
in a rank (a file the loop looks for before every step), and the loss of a rank's node (its
parent, the Dask nanny / the Ray raylet / torchft's torchrun, and the rank's process SIGKILLed
together, with the nanny's fork server where the rank was forked from one; and a new node
started at once, at the least CPU weight while it starts: `start_node`). A fault that falls due
while the group (torchft: the failed replica) is restarting waits for its first step. At the
end the injector writes the last step to train, a little past the step reached, and the run
ends there.

Per run: useful samples/s = the samples of every step from step 2 to the final step, each step
counted once with the ranks that took part in it (torchft goes on with fewer), / the time from
step 1 to the final step. Goodput = that / bare DDP's fault-free samples/s (the mean of its two
runs), and beside it / the same system's own fault-free samples/s (the mean of the runs before
and after it). Per fault, steps lost = the step reached before the restart - the step the
restart resumed from (torchft: the steps thrown away because a peer failed during them);
recovery = the fault -> the first step every rank completed after the restart (torchft: the
failed replica's first step after it came back); torchft also: the steps trained meanwhile by
fewer replicas. Results go into results.json under `figure_name` (the MLP at a fault every 30 s:
figures["goodput"]); the steps over time go to bench/goodput.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("kill", "raise", "node")  # in turn, unless --kinds says otherwise
KIND_NAMES = {"kill": "rank SIGKILL", "raise": "rank exception", "node": "worker/node kill"}
WORLD = 2
POLL_S = 0.1
FT, RAY, TF, DDP = "bench.ft_side", "bench.ray_side", "bench.torchft_side", "bench.ddp_bare"
MODULES = {"ft-train": FT, "ray": RAY, "torchft": TF, "ddp": DDP}
SYSTEMS = ("ft-train", "ray", "torchft")


def loop_config(p: dict, report_every: int) -> dict:
    """The training loop's config for one goodput run (`p`: the measurement's parameters)."""
    control = os.path.join(p["workdir"], "control")
    os.makedirs(control, exist_ok=True)
    return {
        "steps": 10**9,  # until the injector's stop
        "events": os.path.join(p["workdir"], "events.jsonl"),
        "control": control,
        "report_every": report_every,
        "checkpoint_every": p.get("checkpoint_every", 0),
        "upload": "async",
        "snapshot": bool(p.get("snapshot_every")),
        "workload": p.get("workload", "mlp"),
    }


# -- the injector ----------------------------------------------------------------------------


class _Log:
    """What the ranks' event log says so far, read as it grows."""

    def __init__(self, path: str):
        self.path, self.offset, self.rest = path, 0, b""
        self.start_t: dict[int, float] = {}
        self.pid: dict[int, int] = {}
        self.step_t: dict[int, float] = {}
        self.step_one: dict[int, float] = {}
        self.max_step = 0
        self.recent: deque[float] = deque(maxlen=10_000)  # rank 0's latest steps' times

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            e = json.loads(line)
            r = e["rank"]
            if e["event"] == "start":
                self.start_t[r], self.pid[r] = e["t"], e["pid"]
            elif e["event"] == "step":
                self.step_t[r], self.max_step = e["t"], max(self.max_step, e["step"])
                if r == 0:
                    self.recent.append(e["t"])
                if e["step"] == 1:
                    self.step_one.setdefault(r, e["t"])

    def first_step_t(self) -> float | None:
        """When every rank had completed step 1 (the first time)."""
        return max(self.step_one.values()) if len(self.step_one) == WORLD else None

    def stop_step(self) -> int:
        """A step every rank is still before when it next looks: one second's steps past the
        highest yet (the log is read every POLL_S), and a few more."""
        now = time.time()
        return self.max_step + 3 + sum(1 for t in self.recent if t > now - 1)

    def training(self, since: float, restarted: int | None = None) -> bool:
        """Every rank started after `since` (only rank `restarted`, where the system restarts
        only the failed one: torchft) and has completed a step since it started and since
        `since`."""
        must = range(WORLD) if restarted is None else [restarted]
        return all(self.start_t.get(r, 0) > since for r in must) and all(
            self.step_t.get(r, 0) > max(self.start_t.get(r, 0), since) for r in range(WORLD)
        )


class Injector:
    """A thread that injects a fault every `p["fault_every_s"]` (0: none) from the first step,
    then, `p["duration_s"]` after the first step, tells the ranks where to stop. `replace_node`
    starts a new node after a node is lost (and says how: `start_node`). `partial_restart`:
    the system restarts only the failed rank, the others go on (torchft). `faults`: what it
    did, each with its time."""

    def __init__(
        self,
        cfg: dict,
        p: dict,
        replace_node: Callable[[], dict | None],
        partial_restart: bool = False,
    ):
        self.cfg, self.replace_node, self.partial = cfg, replace_node, partial_restart
        self.every_s, self.duration_s = p.get("fault_every_s", 0), p["duration_s"]
        self.kinds = p.get("kinds", KINDS)
        self.faults: list[dict[str, Any]] = []
        self.error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="injector", daemon=True)

    def __enter__(self) -> Injector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()  # the run ended (or failed): nothing left to do
        self._thread.join(60)

    def _run(self) -> None:
        log = _Log(self.cfg["events"])
        try:
            self._faults(log)
        except Exception:  # recorded with the run's figures; the run is ended below
            self.error = traceback.format_exc()
        finally:
            log.poll()
            self._stop(log.stop_step())

    def _faults(self, log: _Log) -> None:
        while (t1 := log.first_step_t()) is None:
            if self._done.wait(POLL_S):
                return
            log.poll()
        last_fault, k, restarted = 0.0, 0, None
        while not self._done.wait(POLL_S) and time.time() < t1 + self.duration_s:
            log.poll()
            due = t1 + (k + 1) * self.every_s
            if self.every_s and time.time() >= due and log.training(last_fault, restarted):
                last_fault = self._inject(k, log)
                restarted = self.faults[-1]["rank"] if self.partial else None
                k += 1

    def _inject(self, k: int, log: _Log) -> float:
        kind, rank = self.kinds[k % len(self.kinds)], (k + 1) % WORLD
        pid = log.pid[rank]
        rec: dict[str, Any] = {"kind": kind, "rank": rank, "pid": pid, "t": time.time()}
        try:
            if kind == "raise":
                open(os.path.join(self.cfg["control"], f"raise-{rank}"), "w").close()
            elif kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                from bench.workload import kill_node, node_processes  # torch is in already

                procs, rec["parent"] = node_processes(pid)
                kill_node(procs)
        except (ProcessLookupError, FileNotFoundError) as e:  # gone already: recorded, not hidden
            rec["error"] = repr(e)
        self.faults.append(rec)
        if kind == "node":
            rec["new_node"] = self.replace_node()
        return rec["t"]

    def _stop(self, step: int) -> None:
        path = os.path.join(self.cfg["control"], "stop")
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)  # a rank reads all of it or nothing


# -- the new node ----------------------------------------------------------------------------

CGROUP_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller, where root may make groups
LOW_SHARES = 2  # the least CPU weight; every other process's group has 1024
LOW_MAX_S = 20.0  # the longest a new node stays at that weight
IDLE = 0.1  # cores: below this for a second, the new node has started


def start_node(cmd: list[str], **popen: Any) -> tuple[subprocess.Popen, dict]:
    """Start a new node in place of a lost one: `cmd`, with Popen's `popen`. On a cluster the
    new node starts on a machine of its own; here it shares the ranks' two cores, and its
    start (a Dask nanny's fork server importing torch; Ray's raylet and workers) took some
    3.5 s of their CPU after every node fault. So, where this process may make a cgroup, the
    node and every process it starts run in one with the least CPU weight until they are idle
    (under IDLE cores for a second) or LOW_MAX_S has passed, then in the root group again, as a
    node that started elsewhere and then joined. Both systems' new nodes start so. Returns the
    process, and a record that says how long the node ran at that weight, once it is known."""
    record: dict[str, Any] = {"low_weight": False}
    group = os.path.join(CGROUP_CPU, f"bench-new-node-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(group)
        with open(os.path.join(group, "cpu.shares"), "w") as f:
            f.write(str(LOW_SHARES))
    except OSError as e:  # no writable cgroup here: the node starts beside the ranks
        record["why_not"] = repr(e)
        return subprocess.Popen(cmd, **popen), record
    # the shell joins the group before it runs the node, so no process of it starts outside
    join = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
    proc = subprocess.Popen(["sh", "-c", join, "sh", group, *cmd], **popen)
    record["low_weight"] = True
    threading.Thread(target=_release, args=(group, record), daemon=True).start()
    return proc, record


def _release(group: str, record: dict) -> None:
    """Move the group's processes back to the root group once they are idle, then remove it."""
    t0 = time.monotonic()
    last, t_last = _cpu_s(group), t0
    while time.monotonic() < t0 + LOW_MAX_S:
        time.sleep(1)
        now, t = _cpu_s(group), time.monotonic()
        if t - t0 >= 2 and now - last < IDLE * (t - t_last):
            break
        last, t_last = now, t
    low_s, cpu_s = round(time.monotonic() - t0, 1), round(_cpu_s(group), 2)
    for _ in range(10):  # again, for a process started meanwhile
        if not (pids := _pids(group)):
            break
        for pid in pids:
            with contextlib.suppress(OSError):  # gone meanwhile
                with open(os.path.join(CGROUP_CPU, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
    with contextlib.suppress(OSError):
        os.rmdir(group)
    record.update(low_weight_s=low_s, cpu_s_at_low_weight=cpu_s)


def _pids(group: str) -> list[int]:
    with open(os.path.join(group, "cgroup.procs")) as f:
        return [int(x) for x in f.read().split()]


def _cpu_s(group: str) -> float:
    """The CPU seconds that the group's processes have used."""
    ticks = 0
    for pid in _pids(group):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


# -- figures from the event log --------------------------------------------------------------


def _by_rank(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        out.setdefault(e["rank"], []).append(e)
    return out


def progress(events: list[dict], batch: int = 1, partial: bool = False) -> dict | None:
    """Step 1 (the first time, every rank) to the final step: steps per second, and useful
    samples per second (`batch`: samples a rank trains a step). Each step counts once, with
    the ranks that took part in it: all of them (WORLD), unless its events say fewer (`n`:
    torchft goes on with the replicas it has). `partial` (torchft): the steps are the group's,
    not a rank's, so the final step is the highest any rank reached, at the time it first did;
    otherwise every rank ends at the stop step, and the final step is the lowest rank's last."""
    ranks = _by_rank(events)
    firsts, lasts = [], []
    for evs in ranks.values():
        steps = [e for e in evs if e["event"] == "step"]
        one = next((e["t"] for e in steps if e["step"] == 1), None)
        if one is None:
            return None
        firsts.append(one)
        lasts.append(steps[-1])
    if len(ranks) < WORLD:
        return None
    t1 = max(firsts)
    if partial:
        top = max(e["step"] for e in events if e["event"] == "step")
        final = top
        end = min(e["t"] for e in events if e["event"] == "step" and e["step"] == top)
    else:
        final, end = min(e["step"] for e in lasts), max(e["t"] for e in lasts)
    wall = end - t1
    took_part: dict[int, int] = {}
    for e in events:
        if e["event"] == "step" and 1 < e["step"] <= final:
            took_part[e["step"]] = max(took_part.get(e["step"], 0), e.get("n", WORLD))
    return {
        "t1": t1,
        "final_step": final,
        "wall_s": wall,
        "steps_per_s": (final - 1) / wall,
        "samples_per_s": sum(took_part.values()) * batch / wall,
    }


def fault_figures(events: list[dict], t_fault: float) -> dict:
    """Steps lost and recovery time of the fault at `t_fault`: on each rank, the last step
    before its first start after the fault, and the first step after that start."""
    reached, resumed, recovered = [], [], []
    for evs in _by_rank(events).values():
        i = next((i for i, e in enumerate(evs) if e["event"] == "start" and e["t"] > t_fault), None)
        if i is None:
            return {"recovered": False}
        before = [e["step"] for e in evs[:i] if e["event"] == "step"]
        after = next((e for e in evs[i:] if e["event"] == "step"), None)
        if after is None:
            return {"recovered": False}
        reached.append(before[-1] if before else 0)
        resumed.append(after["step"] - 1)
        recovered.append(after["t"])
    return {
        "recovered": True,
        "reached": min(reached),
        "resumed_from": min(resumed),
        "lost_steps": min(reached) - min(resumed),
        "recovery_s": max(recovered) - t_fault,
    }


def partial_fault_figures(events: list[dict], t_fault: float, rank: int) -> dict:
    """The figures of a fault at `t_fault` in rank `rank`, where only that rank restarts and
    the others train on (torchft): recovery is the fault to the restarted rank's first step
    (it then trains with the others again); steps lost are the steps trained and thrown away
    meanwhile (a step during which a peer failed is discarded) plus any step the group went
    back by; degraded steps are those committed by fewer than every rank meanwhile."""
    evs = _by_rank(events).get(rank, [])
    i = next((i for i, e in enumerate(evs) if e["event"] == "start" and e["t"] > t_fault), None)
    back = next((e for e in evs[i:] if e["event"] == "step"), None) if i is not None else None
    if back is None:
        return {"recovered": False}
    t_back = back["t"]
    steps = [e for e in events if e["event"] == "step"]
    before = [e["step"] for e in steps if e["t"] <= t_fault]
    after = [e["step"] for e in steps if t_fault < e["t"] <= t_back]
    reached = max(before) if before else 0
    resumed = min(after) - 1 if after else reached
    thrown = sum(1 for e in events if e["event"] == "discard" and t_fault < e["t"] <= t_back)
    degraded = {e["step"] for e in steps if t_fault < e["t"] < t_back and e.get("n", WORLD) < WORLD}
    return {
        "recovered": True,
        "reached": reached,
        "resumed_from": resumed,
        "lost_steps": thrown + max(0, reached - resumed),
        "degraded_steps": len(degraded),
        "recovery_s": t_back - t_fault,
    }


def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "max": max(xs)}


def _series(events: list[dict], t1: float, partial: bool = False) -> list[list[float]]:
    """Rank 0's steps over time (`partial`, torchft: the group's, whichever rank completed
    each), thinned: a point a second, and both sides of every restart and of every pause over
    half a second."""
    if partial:
        steps, top = [], 0
        for e in sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"]):
            if e["step"] > top:
                steps.append(e)
                top = e["step"]
    else:
        steps = [e for e in _by_rank(events).get(0, []) if e["event"] == "step"]
    out: list[list[float]] = []
    for i, e in enumerate(steps):
        nxt, prev = steps[i + 1] if i + 1 < len(steps) else None, steps[i - 1] if i else None
        edge = (nxt is None or nxt["step"] != e["step"] + 1 or nxt["t"] - e["t"] > 0.5) or (
            prev is None or prev["step"] != e["step"] - 1 or e["t"] - prev["t"] > 0.5
        )
        if edge or e["t"] - t1 - out[-1][0] >= 1:
            out.append([round(e["t"] - t1, 2), e["step"]])
    return out


def summarise(
    result: dict, fault_free: float | None, p: dict, batch: int = 1, partial: bool = False
) -> dict:
    """One run's figures from its child's result (`fault_free`: the system's steps/s; `batch`
    and `partial`: as `progress` takes them)."""
    events, faults = result.get("events", []), result.get("faults", [])
    out: dict[str, Any] = {
        "params": {k: v for k, v in p.items() if k not in ("workdir", "s3_endpoint")},
        "status": (result.get("run") or {}).get("status"),
        "error": result.get("error"),
        "injector_error": result.get("injector_error"),
    }
    prog = progress(events, batch, partial)
    if prog is None:
        return out
    t1 = prog.pop("t1")
    per_fault = [
        {
            **{k: f[k] for k in ("kind", "rank") if k in f},
            "t_s": round(f["t"] - t1, 2),
            **{k: f[k] for k in ("error", "new_node") if k in f},
            **(
                partial_fault_figures(events, f["t"], f["rank"])
                if partial
                else fault_figures(events, f["t"])
            ),
        }
        for f in faults
    ]
    done = [f for f in per_fault if f["recovered"]]
    out.update(prog)
    out.update(
        {
            "fault_free_steps_per_s": fault_free,
            "goodput": prog["steps_per_s"] / fault_free if fault_free else None,
            "faults": per_fault,
            "unrecovered": len(per_fault) - len(done),
            "lost_steps": _stats([f["lost_steps"] for f in done]),
            "recovery_s": _stats([f["recovery_s"] for f in done]),
            "by_kind": {
                kind: {
                    "count": len(fs),
                    "lost_steps": _stats([f["lost_steps"] for f in fs]),
                    "recovery_s": _stats([f["recovery_s"] for f in fs]),
                }
                for kind in KINDS
                if (fs := [f for f in done if f["kind"] == kind])
            },
            "degraded_steps": _stats([f["degraded_steps"] for f in done if "degraded_steps" in f]),
            "series": _series(events, t1, partial),
        }
    )
    return out


# -- the runs --------------------------------------------------------------------------------


def samples_per_step(workload: str) -> int:
    """Samples (sequences, for the transformer) a rank trains a step in `workload`."""
    from bench.transformer import CONFIG
    from bench.workload import BATCH

    return {"mlp": BATCH, "transformer": CONFIG.batch}[workload]


def choose_interval(sweep: list[dict]) -> dict | None:
    """The row of the sweep with the highest goodput (of those that have one); of equal ones,
    the longest interval (fewer checkpoints to store). None where no row has a goodput."""
    rows = [r for r in sweep if r.get("goodput") is not None]
    return max(rows, key=lambda r: (r["goodput"], r["interval_s"])) if rows else None


def sweep_table(sweep: list[dict], best: dict | None) -> str:
    out = "Ray's checkpoint interval, swept (goodput: useful samples/s / its fault-free rate)\n"
    for r in sweep:
        g = _f(r.get("goodput"), ".3f")
        mark = "  <- used" if best is not None and r is best else ""
        out += f"  every {r['interval_s']:g} s ({r['checkpoint_every']} steps): {g}{mark}\n"
    return out


def measure(args: argparse.Namespace) -> dict:
    """Every run, one after the other; {name: figures}.

    One piece: the runs share the harness, the fault-free rates measured first and the
    intervals derived from them, in one order that the table and the note describe; split,
    that order would be spread over functions that each need all of it.

    Bare DDP without faults first and last (its samples/s, the mean of the two, is what every
    goodput is judged against); then for each system its fault-free run, (Ray: the sweep of
    its checkpoint interval, the best one kept), its run with faults, and a second fault-free
    run (its own rate: the mean of the two)."""
    from bench.run import Suite, moto_server

    s = Suite(argparse.Namespace(quick=False, keep=args.keep))
    print(f"work directory {s.dir}", flush=True)
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    batch = samples_per_step(args.workload)
    base = {"workload": args.workload, "storage": args.storage}
    runs: dict[str, dict] = {}

    def child(name: str, system: str, p: dict) -> dict:
        r = s.child(MODULES[system], "goodput", {**base, **p}, timeout=p["duration_s"] + 900)
        runs[name] = summarise(r, None, p, batch, partial=system == "torchft")
        runs[name]["system"] = system
        if r.get("error") or r.get("log_tail"):
            runs[name]["log_tail"] = r.get("log_tail")
        return runs[name]

    with moto_server() if args.storage == "s3" else contextlib.nullcontext() as endpoint:
        s.s3_endpoint = endpoint
        kinds = [k.strip() for k in args.kinds.split(",")]
        fault_free = {"duration_s": args.fault_free_minutes * 60, "fault_every_s": 0}
        ddp = [child("ddp, fault-free", "ddp", fault_free).get("samples_per_s")]
        for system in systems:
            ff = child(f"{system}, fault-free", system, fault_free)
            before, before_samples = ff.get("steps_per_s"), ff.get("samples_per_s")
            if not before:
                continue  # its fault-free run failed: no intervals to derive, nothing to compare
            every = round(args.checkpoint_every * before)
            faulted = {"fault_every_s": args.fault_every, "checkpoint_every": every, "kinds": kinds}
            if system == "ray" and args.ray_sweep:
                sweep = []
                for iv in [float(x) for x in args.ray_sweep.split(",")]:
                    p = {
                        **faulted,
                        "checkpoint_every": max(1, round(iv * before)),
                        "duration_s": args.sweep_minutes * 60,
                    }
                    r = child(f"ray, sweep {iv:g} s", system, p)
                    g = r["samples_per_s"] / before_samples if r.get("samples_per_s") else None
                    sweep.append({"interval_s": iv, "checkpoint_every": p["checkpoint_every"]})
                    sweep[-1]["goodput"] = g
                best = choose_interval(sweep)
                print(sweep_table(sweep, best), flush=True)
                if best is not None:
                    faulted["checkpoint_every"] = best["checkpoint_every"]
            on = {**faulted, "duration_s": args.minutes * 60}
            if system == "ft-train":
                on["snapshot_every"] = max(1, round(args.snapshot_every_s * before))
            child(system, system, on)  # its goodput: rebase(), once the pace is known
            if system == "ray" and args.ray_sweep:
                runs[system]["sweep"] = sweep
            # the host drifts by several % over minutes: the faulted run's pace is compared
            # with the mean of a fault-free run before it and one after it
            after = child(f"{system}, fault-free after", system, fault_free)
            own = [before_samples, after.get("samples_per_s")]
            rebase(runs[system], [before, after.get("steps_per_s")], own)
            if system == "ft-train" and args.off_minutes:
                off = {**faulted, "duration_s": args.off_minutes * 60}
                child("ft-train, snapshots off", system, off)
                rebase(runs["ft-train, snapshots off"], [before, after.get("steps_per_s")], own)
        ddp.append(child("ddp, fault-free after", "ddp", fault_free).get("samples_per_s"))
    for name, run in runs.items():
        if "fault-free" not in name and "sweep" not in name:
            against_ddp(run, ddp)
    return runs


def state_check(args: argparse.Namespace) -> dict:
    """The transformer workload's state, checkpointed once and restored once by ft-train, to
    local storage and to the loopback S3: `bench.ft_side recovery` (a checkpoint at step 5, a
    rank SIGKILLed at step 7, the restore). {storage: figures}."""
    from bench.run import Suite, moto_server
    from bench.workload import recovery_s

    s = Suite(argparse.Namespace(quick=False, keep=args.keep))
    out = {}
    with moto_server() as endpoint:
        s.s3_endpoint = endpoint
        for storage in ("local", "s3"):
            r = s.child(FT, "recovery", {"workload": "transformer", "storage": storage})
            ck = [e for e in r.get("events", []) if e["event"] == "ckpt" and e["rank"] == 0]
            out[storage] = {
                "status": (r.get("run") or {}).get("status"),
                "error": r.get("error"),
                "checkpoint_bytes": ck[0]["bytes"] if ck else None,
                "checkpoint_stall_s": ck[0]["stall_s"] if ck else None,
                "recovery_s": recovery_s(r.get("events", [])),
            }
            print(f"  {storage}: {out[storage]}", flush=True)
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x]
    return statistics.fmean(xs) if xs else None


def rebase(run: dict, measured: list, measured_samples: list) -> None:
    """`run`'s goodput against its own fault-free runs (`measured`: their steps/s,
    `measured_samples`: their samples/s): its useful samples/s / the mean of theirs."""
    run["fault_free_steps_per_s"], run["fault_free_measured"] = _mean(measured), measured
    run["fault_free_samples_per_s"] = rate = _mean(measured_samples)
    if run.get("samples_per_s") and rate:
        run["goodput"] = run["samples_per_s"] / rate


def against_ddp(run: dict, ddp: list) -> None:
    """`run`'s useful samples/s / bare DDP's fault-free samples/s (`ddp`: the runs in this
    invocation; their mean): the goodput the issue judges."""
    run["ddp_samples_per_s"], run["ddp_measured"] = _mean(ddp), ddp
    if run.get("samples_per_s") and run["ddp_samples_per_s"]:
        run["goodput_vs_ddp"] = run["samples_per_s"] / run["ddp_samples_per_s"]


def targets(runs: dict) -> dict:
    """The issue's targets, each True/False, or None where a figure is missing: goodput is
    useful samples/s / bare DDP's."""
    ft, ray, tf = runs.get("ft-train", {}), runs.get("ray", {}), runs.get("torchft", {})
    g, rg, tg = ft.get("goodput_vs_ddp"), ray.get("goodput_vs_ddp"), tf.get("goodput_vs_ddp")
    lost, rlost = ft.get("lost_steps"), ray.get("lost_steps")
    snap = ft.get("params", {}).get("snapshot_every")
    return {
        "goodput (/ bare DDP) >= 0.95": None if g is None else g >= 0.95,
        "steps lost per failure <= one snapshot interval": (
            None if lost is None or not snap else lost["max"] <= snap
        ),
        "goodput ahead of Ray's": None if g is None or rg is None else g > rg,
        "goodput ahead of torchft's": None if g is None or tg is None else g > tg,
        "steps lost per failure fewer than Ray's (mean)": (
            None if lost is None or rlost is None else lost["mean"] < rlost["mean"]
        ),
    }


# -- the table and the plot ------------------------------------------------------------------

ORDER = ["ft-train", "ft-train, snapshots off", "ray", "torchft"]
HEAD = {"ft-train": "ft-train, snapshots on", "ray": "Ray Train V2", "torchft": "torchft"}


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _med_max(s: dict | None, fmt: str) -> str:
    return "n/a" if s is None else f"{s['median']:{fmt}} / {s['max']:{fmt}}"


def _fault_free(r: dict) -> str:
    runs = ", ".join(_f(x) for x in r.get("fault_free_measured") or [])
    return _f(r.get("fault_free_steps_per_s")) + (f" ({runs})" if runs else "")


def table(fig: dict) -> str:
    runs = fig.get("runs", {})
    names = [n for n in ORDER if n in runs]
    rows: list[tuple[str, Callable[[dict], str]]] = [
        (
            "goodput: useful samples/s / bare DDP's samples/s (same invocation)",
            lambda r: _f(r.get("goodput_vs_ddp"), ".3f"),
        ),
        (
            "useful samples/s / its own fault-free samples/s",
            lambda r: _f(r.get("goodput"), ".3f"),
        ),
        ("useful samples/s under faults", lambda r: _f(r.get("samples_per_s"), ".1f")),
        (
            "bare DDP's samples/s: the mean (before, after)",
            lambda r: (
                _f(r.get("ddp_samples_per_s"), ".1f")
                + f" ({', '.join(_f(x, '.1f') for x in r.get('ddp_measured') or [])})"
            ),
        ),
        ("steps/s under faults", lambda r: _f(r.get("steps_per_s"))),
        ("fault-free steps/s: the mean (before, after)", _fault_free),
        (
            "run from step 1: seconds, final step, faults (not recovered)",
            lambda r: (
                f"{_f(r.get('wall_s'), '.0f')} s, {r.get('final_step', 'n/a')}, "
                f"{len(r.get('faults', []))} ({r.get('unrecovered', 'n/a')})"
            ),
        ),
        (
            "checkpoint / snapshot every (steps)",
            lambda r: (
                f"{r['params'].get('checkpoint_every', 'n/a')} / "
                f"{r['params'].get('snapshot_every') or 'off'}"
            ),
        ),
        ("steps lost per failure, median / max", lambda r: _med_max(r.get("lost_steps"), ".0f")),
        ("recovery s, median / max", lambda r: _med_max(r.get("recovery_s"), ".2f")),
        (
            "steps with fewer replicas per failure, median / max",
            lambda r: _med_max(r.get("degraded_steps"), ".0f"),
        ),
    ]
    for kind in KINDS:
        rows.append(
            (
                f"{KIND_NAMES[kind]}: steps lost, recovery s (medians)",
                lambda r, k=kind: (
                    "n/a"
                    if k not in r.get("by_kind", {})
                    else f"{r['by_kind'][k]['lost_steps']['median']:.0f}, "
                    f"{r['by_kind'][k]['recovery_s']['median']:.2f} "
                    f"({r['by_kind'][k]['count']})"
                ),
            )
        )
    out = "| | " + " | ".join(HEAD.get(n, n) for n in names) + " |\n"
    out += "|---" * (len(names) + 1) + "|\n"
    for label, cell in rows:
        out += f"| {label} | " + " | ".join(cell(runs[n]) for n in names) + " |\n"
    met = {True: "met", False: "MISSED", None: "n/a"}
    out += "\n" + "\n".join(f"- {k}: {met[v]}" for k, v in fig.get("targets", {}).items())
    return out + "\n"


def _step_at(series: list[list[float]], t: float) -> float:
    """The step of a thinned series at `t` seconds (the last point at or before it)."""
    return max((p for p in series if p[0] <= t), key=lambda p: p[0], default=[0, 0])[1]


def draw(fig: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "ft-train": "tab:blue",
        "ft-train, snapshots off": "tab:green",
        "ray": "tab:orange",
        "torchft": "tab:red",
    }
    f, ax = plt.subplots(figsize=(11, 5.5))
    for name, color in colors.items():
        r = fig.get("runs", {}).get(name)
        if not r or not r.get("series"):
            continue
        faults = [fl for fl in r.get("faults", []) if fl.get("recovered")]
        xs: list[float] = []
        ys: list[float] = []
        for i, (t, step) in enumerate(r["series"]):
            if i and any(r["series"][i - 1][0] < fl["t_s"] <= t for fl in faults):
                xs.append(float("nan"))  # a restart: no line across it
                ys.append(float("nan"))
            xs.append(t / 60)
            ys.append(step)
        partial = r.get("system") == "torchft"  # the group trains on: no line drops back
        for fl in [] if partial else faults:
            # at the fault, back to the step resumed from, until the first step
            t0, t1 = fl["t_s"] / 60, (fl["t_s"] + fl["recovery_s"]) / 60
            xs += [float("nan"), t0, t0, t1]
            ys += [float("nan"), fl["reached"], fl["resumed_from"], fl["resumed_from"]]
        g = r.get("goodput_vs_ddp", r.get("goodput"))
        good = f" (goodput {g:.2f})" if g is not None else ""
        ax.plot(xs, ys, color=color, lw=1.2, label=HEAD.get(name, name) + good)
        for fl in faults:
            ax.plot(fl["t_s"] / 60, fl["reached"], "x", color=color, ms=5)
            if partial:  # the failed replica back: a circle on the group's line
                back = (fl["t_s"] + fl["recovery_s"]) / 60
                ax.plot(back, _step_at(r["series"], back * 60), "o", mfc="none", color=color)
        if r.get("fault_free_steps_per_s") and r.get("wall_s"):
            end = r["wall_s"]
            ax.plot([0, end / 60], [1, 1 + end * r["fault_free_steps_per_s"]], ":", color=color)
    ax.set_xlabel("minutes from step 1")
    ax.set_ylabel("step (rank 0)")
    every = fig.get("params", {}).get("fault_every_s", "?")
    workload = fig.get("params", {}).get("workload", "mlp")
    ax.set_title(
        f"Steps over time, {workload}, a fault every {every} s (x: a fault; o: a torchft"
        " replica back; dotted: fault-free)"
    )
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    f.tight_layout()
    f.savefig(path, dpi=110)
    plt.close(f)


# -- main ------------------------------------------------------------------------------------


def figure_name(args: argparse.Namespace) -> str:
    """Where a run's figures go in results.json: "goodput" for the MLP at a fault every 30 s
    (the figure of record since the first series), else named by workload and fault interval."""
    if args.workload == "mlp" and args.fault_every == 30:
        return "goodput"
    return f"goodput, {args.workload}, a fault every {args.fault_every:g} s"


def save(fig_runs: dict, args: argparse.Namespace, before: str) -> dict:
    """Into results.json under `figure_name`, in place of that figure's earlier runs, keeping
    every other figure."""
    from bench.run import commit, load, machine

    stored: dict[str, Any] = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            stored = json.load(f)
    figures = stored.setdefault("figures", {})
    fig = {
        "params": {
            "minutes": args.minutes,
            "fault_every_s": args.fault_every,
            "checkpoint_every_s": args.checkpoint_every,
            "snapshot_every_s": args.snapshot_every_s,
            "off_minutes": args.off_minutes,
            "fault_free_minutes": args.fault_free_minutes,
            "kinds": args.kinds.split(","),
            "workload": args.workload,
            "storage": args.storage,
            "ray_sweep": args.ray_sweep,
            "sweep_minutes": args.sweep_minutes,
        },
        "runs": fig_runs,
    }
    fig["targets"] = targets(fig["runs"])
    figures[figure_name(args)] = fig
    stored.setdefault("runs", {})[figure_name(args)] = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.goodput", *sys.argv[1:]]),
        "load": before,
        "load_after": load(),
        "commit": commit(),
        "machine": machine(),
    }
    with open(args.results, "w") as f:
        json.dump(stored, f, indent=1)
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10, help="each run with faults (snapshots on)")
    p.add_argument(
        "--fault-every", type=float, default=30, help="seconds between faults: 30, or 120"
    )
    p.add_argument("--checkpoint-every", type=float, default=60, help="seconds' worth of steps")
    p.add_argument("--snapshot-every-s", type=float, default=5, help="seconds' worth of steps")
    p.add_argument("--off-minutes", type=float, default=5, help="ft-train, snapshots off; 0: none")
    p.add_argument("--fault-free-minutes", type=float, default=2)
    p.add_argument("--kinds", default=",".join(KINDS), help="the faults' order, from " + str(KINDS))
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"some of {', '.join(SYSTEMS)}, in order"
    )
    p.add_argument("--workload", default="mlp", choices=("mlp", "transformer"))
    p.add_argument("--storage", default="local", choices=("local", "s3"), help="s3: loopback")
    p.add_argument(
        "--ray-sweep",
        default="5,15,60",
        help="Ray's checkpoint intervals to try first, in seconds' worth of steps; the best is "
        "used in its run ('': no sweep, --checkpoint-every)",
    )
    p.add_argument("--sweep-minutes", type=float, default=2, help="each run of Ray's sweep")
    p.add_argument("--keep", action="store_true", help="keep each run's work directory")
    p.add_argument("--results", default=os.path.join(HERE, "results.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "goodput.png"))
    p.add_argument("--table", action="store_true", help="print the stored figures and exit")
    p.add_argument(
        "--state-check",
        action="store_true",
        help="only: the transformer's state checkpointed and restored once, local and S3",
    )
    args = p.parse_args(argv)
    if set(args.kinds.split(",")) - set(KINDS):
        p.error(f"--kinds: choose from {KINDS}")
    if unknown := {x.strip() for x in args.systems.split(",")} - set(SYSTEMS):
        p.error(f"--systems: {sorted(unknown)} unknown; choose from {', '.join(SYSTEMS)}")
    try:
        [float(x) for x in args.ray_sweep.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ray-sweep {args.ray_sweep!r}: seconds separated by commas, e.g. 5,15,60")
    if args.table:
        with open(args.results) as f:
            print(table(json.load(f)["figures"][figure_name(args)]))
        return
    if args.state_check:
        print(json.dumps(state_check(args), indent=1))
        return
    from bench.run import load

    before = load()
    fig = save(measure(args), args, before)
    print("\n" + table(fig))
    print(f"results: {args.results}")
    draw(fig, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
