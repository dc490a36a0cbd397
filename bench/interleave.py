"""Steady-state throughput of ft-train against bare DDP, measured by taking turns.

On these 2-core hosts the steps a second of one run drift by +-10% over tens of seconds (the
host's load), and two runs started the same way can differ by a few percent for as long as they
live (where their memory lies). Run one after the other, five pairs could not tell 0.96x from
1.00x. Here all the runs are alive at once and take turns: each trains for `slice_s` while every
other run's whole process group is stopped (SIGSTOP), so it has the cores to itself, and all of
them share the same minutes of the host. Several runs of each system average out the rest.

A run's rate: the steps rank 0 completed during its turns, from `margin_s` after each turn began
(the step in flight when the turn began had waited through the others' turns), over the time they
took. Each run warms up alone (to step 20) before the turns begin.

No run stays stopped longer than `max_stop_s()`, below the time ft-train's Dask scheduler waits
for a silent worker (`worker-ttl`, 60 s). A run stopped longer has its workers dropped when it
resumes, and restarts its ranks, as it should: its turns then time a restart, not steady state.
So the runs take their turns in one order every cycle (reversing it every other cycle stopped the
first and last runs for two cycles' turns), and a run that waits for another to warm up is let
run for a moment every `KEEP_ALIVE_EVERY_S`. A run that restarted anyway is counted
(`restarts`), and the figure is then not one of steady state.

A diagnostic, not a figure: with `ranks_only`, a third kind of run is ft-train with only its
rank processes let run in its turns; its driver, Prefect server, fork server and spare stay
stopped, and catch up for `CATCH_UP_S` between turns, outside any measured window. It tells how
much of a gap is the work beside the ranks.

    python -m bench.interleave [--instances N] [--cycles N] [--ranks-only] [--baseline DIR]

With `--baseline DIR` (another checkout: an earlier commit), its runs take the same turns, and
report() is timed in both afterwards: figures before and after a change, from one invocation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

WARMUP_STEPS = 20
WARMUP_TIMEOUT_S = 300.0
CATCH_UP_S = 0.3  # ranks_only: the other processes of the run, between its turns
KEEP_ALIVE_EVERY_S = 15.0  # while one run warms up, the others run for KEEP_ALIVE_S this often
KEEP_ALIVE_S = 1.0


def max_stop_s() -> float:
    """The longest a run may stay stopped: four fifths of ft-train's worker-ttl."""
    from dask.utils import parse_timedelta

    from ft_train.driver.dask_settings import DASK_SETTINGS

    return 0.8 * parse_timedelta(DASK_SETTINGS["distributed.scheduler.worker-ttl"])


class Run:
    """One measurement process (`bench.ft_side steady` or `bench.ddp_bare steady`) in its own
    process group: its fork server, Dask workers, Prefect server and ranks stop and go with it."""

    def __init__(self, module: str, work: str, log: str, env: dict, cwd: str):
        self.work = work
        self.events = os.path.join(work, "events.jsonl")
        self.windows: list[tuple[float, float]] = []
        params = {"workdir": work, "steps": 10**7}  # never ends: killed after the last turn
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    module,
                    "steady",
                    json.dumps(params),
                    os.path.join(work, "out.json"),
                ],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def rank0(self, event: str) -> list[dict]:
        """Rank 0's records of `event` so far."""
        if not os.path.exists(self.events):
            return []
        with open(self.events) as f:
            recs = [json.loads(line) for line in f if f'"event": "{event}"' in line]
        return [e for e in recs if e["rank"] == 0]

    def steps(self) -> list[tuple[int, float]]:
        """(step, time) of rank 0's steps so far."""
        return [(e["step"], e["t"]) for e in self.rank0("step")]

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def restarts(self) -> int:
        """How many times rank 0 started again once the turns had begun."""
        if not self.windows:
            return 0
        return sum(1 for e in self.rank0("start") if e["t"] > self.windows[0][0])

    def warm_up(self, waiting: list[Run]) -> None:
        """Until rank 0 reaches WARMUP_STEPS; the `waiting` runs (stopped) are let run for a
        moment every KEEP_ALIVE_EVERY_S meanwhile."""
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        kept = time.monotonic()
        while not (s := self.steps()) or s[-1][0] < WARMUP_STEPS:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.work}: no step {WARMUP_STEPS} (exit {self.proc.poll()})")
            if time.monotonic() - kept > KEEP_ALIVE_EVERY_S:
                for run in waiting:
                    run.signal(signal.SIGCONT)
                time.sleep(KEEP_ALIVE_S)
                for run in waiting:
                    run.signal(signal.SIGSTOP)
                kept = time.monotonic()
            time.sleep(0.2)  # polling the run's event file for a condition, bounded above
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def turn(self, slice_s: float) -> None:
        self.resume()
        start = time.time()
        time.sleep(slice_s)
        self.signal(signal.SIGSTOP)
        self.windows.append((start, time.time()))

    def kill(self) -> None:
        try:
            self.signal(signal.SIGKILL)  # a stopped process dies of it too
        except ProcessLookupError:
            pass
        self.proc.wait()

    def rates(self, margin_s: float) -> tuple[float | None, list[float]]:
        """(steps/s over all turns, steps/s of each turn)."""
        ts = sorted(t for _, t in self.steps())
        n = dt = 0.0
        per = []
        for a, b in self.windows:
            w = [t for t in ts if a + margin_s < t <= b]
            if len(w) > 2:
                n, dt = n + len(w) - 1, dt + w[-1] - w[0]
                per.append((len(w) - 1) / (w[-1] - w[0]))
        return (n / dt if dt else None), per


class RanksOnly(Run):
    """An ft-train run whose turns let its rank processes alone run (the diagnostic above)."""

    others: list[int]  # the run's processes other than its ranks, found as each turn begins

    def resume(self) -> None:
        self.others = [p for p in _group(self.proc.pid) if not _is_rank(p)]
        super().resume()
        _send(self.others, signal.SIGSTOP)

    def turn(self, slice_s: float) -> None:
        super().turn(slice_s)  # ends with the whole group stopped
        _send(self.others, signal.SIGCONT)
        time.sleep(CATCH_UP_S)
        _send(self.others, signal.SIGSTOP)


def _group(pgid: int) -> list[int]:
    """The processes of a process group, from /proc."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                pids.append(int(pid))
        except ProcessLookupError:
            pass
    return pids


def _is_rank(pid: int) -> bool:
    """Has the process a gloo thread: it is a rank, not the driver, a server or a spare."""
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                if f.read().startswith("pt_gloo"):
                    return True
    except OSError:
        pass
    return False


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def measure(
    base: str,
    env: dict,
    cwd: str,
    instances: int = 3,
    cycles: int = 10,
    slice_s: float = 5.0,
    margin_s: float = 0.5,
    ranks_only: bool = False,
    baseline: str | None = None,
) -> dict:
    """`instances` runs of each system taking `cycles` turns each, in the same order every cycle.
    Work directories and logs under `base`. `baseline`: another checkout of ft-train (an earlier
    commit), whose runs ("ft-train-baseline") take turns with the others."""
    systems = {"ft-train": "bench.ft_side", "ddp": "bench.ddp_bare"}
    if ranks_only:
        systems["ft-train-ranks-only"] = "bench.ft_side"
    if baseline:
        systems["ft-train-baseline"] = "bench.ft_side"
    n = instances * len(systems)
    # A run waits through the others' turns; with ranks_only, its driver through its own as well.
    stop_s = (n - 1) * slice_s if not ranks_only else n * (slice_s + CATCH_UP_S)
    if stop_s > max_stop_s():
        raise ValueError(
            f"{instances} instances of {len(systems)} systems taking {slice_s:g} s turns stop "
            f"each run for {stop_s:.0f} s, over {max_stop_s():.0f} s: ft-train's scheduler "
            "would drop its workers; use fewer instances or shorter turns"
        )
    runs: list[tuple[str, Run]] = []
    try:
        for i in range(instances):
            for system, module in systems.items():
                work = os.path.join(base, f"{system}-{i}")
                os.makedirs(work)
                print(f"  .. {system} run {i + 1} of {instances}: warming up", flush=True)
                kind = RanksOnly if system == "ft-train-ranks-only" else Run
                where = baseline if system == "ft-train-baseline" else cwd
                run = kind(module, work, work + ".log", {**env, "PYTHONPATH": where}, where)
                run.warm_up([r for _, r in runs])
                runs.append((system, run))
        print(f"  .. {len(runs)} runs taking {cycles} turns of {slice_s:.0f} s", flush=True)
        for _ in range(cycles):
            for _, run in runs:
                run.turn(slice_s)
    finally:
        for _, run in runs:
            run.kill()
    out: dict = {
        "method": "interleaved",
        "instances": instances,
        "cycles": cycles,
        "slice_s": slice_s,
        "margin_s": margin_s,
    }
    for system in systems:
        rates = [run.rates(margin_s) for s, run in runs if s == system]
        overall = [r for r, _ in rates if r is not None]
        out[system] = {
            "steps_per_s": sum(overall) / len(overall) if overall else None,  # mean over runs
            "runs_steps_per_s": overall,
            "turns_steps_per_s": [per for _, per in rates],
            "restarts": [run.restarts() for s, run in runs if s == system],
        }
    ft, ddp = out["ft-train"]["steps_per_s"], out["ddp"]["steps_per_s"]
    out["ratio"] = ft / ddp if ft and ddp else None
    if ranks_only:
        only = out["ft-train-ranks-only"]["steps_per_s"]
        out["ratio_ranks_only"] = only / ddp if only and ddp else None
    if baseline:
        before = out["ft-train-baseline"]["steps_per_s"]
        out["ratio_baseline"] = before / ddp if before and ddp else None
    return out


def report_times(
    base: str, env: dict, trees: dict[str, str], steps: int = 600, reps: int = 2
) -> dict:
    """report()'s blocking time in runs of `steps` steps of each tree, one after the other,
    alternating `reps` times (`bench.workload.report_stats` over all of a tree's calls)."""
    from bench.workload import report_stats

    events: dict[str, list] = {name: [] for name in trees}
    for i in range(reps):
        for name, tree in trees.items():
            work = os.path.join(base, f"report-{name}-{i}")
            os.makedirs(work)
            print(f"  .. report(): {name} run {i + 1} of {reps}", flush=True)
            out = os.path.join(work, "out.json")
            params = {"workdir": work, "steps": steps}
            with open(work + ".log", "wb") as log:
                subprocess.run(
                    [sys.executable, "-m", "bench.ft_side", "steady", json.dumps(params), out],
                    cwd=tree,
                    env={**env, "PYTHONPATH": tree},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=600,
                    check=True,
                )
            with open(out) as f:
                events[name] += json.load(f)["events"]
    return {name: report_stats(evs) for name, evs in events.items()}


def restarted(out: dict) -> str:
    """The systems whose runs restarted during the turns, with how often; "" if none did."""
    return ", ".join(
        f"{system} {f['restarts']}"
        for system, f in out.items()
        if isinstance(f, dict) and any(f.get("restarts", ()))
    )


def main() -> None:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=3, help="runs of each system (default 3)")
    p.add_argument("--cycles", type=int, default=10, help="turns each run takes (default 10)")
    p.add_argument(
        "--ranks-only",
        action="store_true",
        help="add ft-train runs whose turns let only the rank processes run",
    )
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="another checkout of ft-train (e.g. `git worktree add DIR COMMIT`): its runs "
        "take turns with the others, and report() is timed in both",
    )
    args = p.parse_args()
    baseline = os.path.abspath(args.baseline) if args.baseline else None
    with tempfile.TemporaryDirectory(prefix="ft-interleave-") as base:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {
            **os.environ,
            "PYTHONPATH": repo,
            "PREFECT_HOME": os.path.join(base, "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }  # as bench.run's Suite
        env.pop("PREFECT_API_URL", None)  # Prefect's ephemeral mode, as in bench.run's figure
        out = measure(
            base,
            env,
            repo,
            args.instances,
            args.cycles,
            ranks_only=args.ranks_only,
            baseline=baseline,
        )
        reports = (
            report_times(base, env, {"ft-train": repo, "ft-train-baseline": baseline})
            if baseline
            else {}
        )
    for system, f in out.items():
        if isinstance(f, dict):
            runs = ", ".join(f"{x:.2f}" for x in f["runs_steps_per_s"])
            turns = [
                len(t) for t in f["turns_steps_per_s"]
            ]  # a turn with under 3 steps is left out
            counted = "" if min(turns) == args.cycles else f"; turns counted: {turns}"
            print(f"{system:20} {f['steps_per_s']:6.2f} steps/s (runs: {runs}{counted})")
    print(f"ft-train / bare DDP: {out['ratio']:.3f}")
    if restarts := restarted(out):
        print(f"NOT steady state: runs restarted their ranks during the turns ({restarts})")
    if args.ranks_only:
        print(f"ft-train with its ranks only / bare DDP: {out['ratio_ranks_only']:.3f}")
    if baseline:
        print(f"ft-train at {baseline} / bare DDP: {out['ratio_baseline']:.3f}")
    for name, st in reports.items():
        print(
            f"report() {name:20} median {st['median_ms']:.3f} ms, p99 {st['p99_ms']:.3f} ms "
            f"({st['calls']} calls)"
        )


if __name__ == "__main__":
    main()
