"""report() and steady-state throughput in two trees, and the cost of polling
get_preemption_info() at every step (issue 41).

    python -m bench.report_cost BEFORE_TREE [--after TREE] [--reps 3] [--steps 500] [--out J]

Runs `bench.ft_side steady` (metrics reported every step, as `bench/run.py`'s "report" and
"throughput" figures) in a fresh process per run, with PYTHONPATH and cwd the tree, PREFECT_HOME
a temporary directory and PREFECT_SERVER_ANALYTICS_ENABLED=false. Three variants: "before" (the
BEFORE tree), "after" (this tree, or --after) and "after+poll" (the after tree, with
get_preemption_info() after every optimizer step: the loop's `poll_preemption`; only in a tree
that has it). Each cycle runs the three in turn, the order reversed every other cycle (before,
after, poll; poll, after, before; ...), so that none always goes first. Per run: report()'s median
blocking time over both ranks (`workload.report_stats`, the first two calls of each rank left
out) and steps/s on rank 0 from step 10 (`workload.throughput`); then the medians over the runs
and the ratios after/before and poll/after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import workload as W

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(tree: str) -> str:
    out = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def one_run(tree: str, params: dict, home: str, work: str, timeout: float) -> dict:
    """`python -m bench.ft_side steady PARAMS OUT` in `tree`; its JSON result or {"error"}."""
    os.makedirs(work)
    out, log = os.path.join(work, "out.json"), os.path.join(work, "log.txt")
    params = {**params, "workdir": work, "s3_endpoint": None}
    env = dict(
        os.environ,
        PYTHONPATH=tree,
        PREFECT_HOME=home,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
    )
    env.pop("PREFECT_API_URL", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.ft_side", "steady", json.dumps(params), out],
            cwd=tree,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the group this call started (start_new_session)
            proc.wait()
            rc = "timeout"
    if rc == 0 and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    with open(log, errors="replace") as f:
        return {"error": f"exit {rc}", "log_tail": f.read()[-2000:]}


def figures(result: dict) -> dict:
    events = result.get("events", [])
    report = W.report_stats(events)
    return {
        "report_median_ms": report["median_ms"] if report else None,
        "report_p99_ms": report["p99_ms"] if report else None,
        "steps_per_s": W.throughput(events, warmup=10),
        "notices": sum(e["event"] == "preemption_notice" for e in events),
        "status": result.get("run", {}).get("status"),
        "error": result.get("error"),
    }


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", help="the baseline tree (a git worktree)")
    ap.add_argument("--after", default=HERE, help="the tree compared with it (default: this one)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each variant")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--no-poll", action="store_true", help="leave out the after+poll variant")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", help="write every run's figures here (JSON)")
    args = ap.parse_args(argv)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    variants = [("before", trees["before"], {}), ("after", trees["after"], {})]
    if not args.no_poll:
        variants.append(("after+poll", trees["after"], {"poll_preemption": True}))
    print(f"before {commit(trees['before'])} {trees['before']}")
    print(f"after  {commit(trees['after'])} {trees['after']}")
    print(f"{args.reps} cycles of {len(variants)} runs, {args.steps} steps a run", flush=True)
    scratch = tempfile.mkdtemp(prefix="report-cost-")
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    try:
        n = 0
        for cycle in range(args.reps):
            order = variants if cycle % 2 == 0 else variants[::-1]
            for name, tree, extra in order:
                n += 1
                load = os.getloadavg()[0]
                t0 = time.time()
                result = one_run(
                    tree,
                    {"steps": args.steps, **extra},
                    os.path.join(scratch, f"prefect-home-{name}"),
                    os.path.join(scratch, f"{n:02d}-{name}"),
                    args.timeout,
                )
                fig = {**figures(result), "load1": load, "wall_s": time.time() - t0}
                runs[name].append(fig)
                print(
                    f"  run {n:2d} {name:10s} report() median {_f(fig['report_median_ms'], 3)} ms"
                    f"  p99 {_f(fig['report_p99_ms'], 3)} ms  {_f(fig['steps_per_s'], 2)} steps/s"
                    f"  (load {load:.2f}, {fig['wall_s']:.0f} s{', notices ' if fig['notices'] else ''}"
                    f"{fig['notices'] or ''}{', ERROR ' + str(fig['error']) if fig['error'] else ''})",
                    flush=True,
                )
                if fig["error"]:
                    print(result.get("log_tail", ""), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    print("\nvariant     report() median ms (runs)            steps/s (runs)")
    for name, figs in runs.items():
        rep = [f["report_median_ms"] for f in figs]
        sps = [f["steps_per_s"] for f in figs]
        summary[name] = {"report_median_ms": median(rep), "steps_per_s": median(sps)}
        print(
            f"{name:10s}  {_f(median(rep), 3)} ({', '.join(_f(v, 3) for v in rep)})"
            f"   {_f(median(sps), 2)} ({', '.join(_f(v, 2) for v in sps)})"
        )
    ratios = {
        "after/before": ("after", "before"),
        "after+poll/after": ("after+poll", "after"),
    }
    for label, (a, b) in ratios.items():
        if a in summary and b in summary:
            r_rep = ratio(summary[a]["report_median_ms"], summary[b]["report_median_ms"])
            r_sps = ratio(summary[a]["steps_per_s"], summary[b]["steps_per_s"])
            summary[label] = {"report_median_ms": r_rep, "steps_per_s": r_sps}
            print(f"{label:17s} report() median x{_f(r_rep, 3)}   steps/s x{_f(r_sps, 3)}")
    if "after+poll" in summary:
        a, p = summary["after"]["steps_per_s"], summary["after+poll"]["steps_per_s"]
        if a and p:
            cost_us = 1e6 * (1 / p - 1 / a)
            summary["poll_cost_us_per_step"] = cost_us
            print(f"polling every step: {cost_us:+.0f} us a step (median steps/s, poll vs not)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trees": trees, "steps": args.steps, "runs": runs, "summary": summary}, f)


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    main()
