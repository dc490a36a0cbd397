"""Before and after: `bench.run` in an earlier checkout of ft-train and in this tree, figure by
figure, taking turns, then each figure of both side by side.

    git worktree add /tmp/before COMMIT
    .venv-bench/bin/python -m bench.compare --baseline /tmp/before [--only report,recovery] [--full]

Each figure runs in the baseline tree, then in this one (the order swaps at every figure, so
that neither tree always meets a machine just warmed up or just loaded). Both trees run Ray's
side too: its figure beside each is the control, so a change of load between the two turns
shows as a change of Ray's figure. `--quick` is the default; `--full` runs the full series.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.run import FIGURES, REPO, rows


def run_figure(tree: str, figure: str, results: str, quick: bool) -> None:
    """`python -m bench.run --only figure` in `tree` (its own code, its own harness), its
    figures merged into `results`."""
    cmd = [sys.executable, "-m", "bench.run", "--only", figure, "--results", results]
    cmd += ["--timeline", results + ".png"] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": tree}
    print(f"== {figure} in {tree}", flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=False)


def figures_of(results: str) -> dict:
    if not os.path.exists(results):
        return {}
    with open(results) as f:
        return json.load(f).get("figures", {})


def side_by_side(before: dict, after: dict) -> str:
    """A markdown table: each row of `bench.run`'s table, before and after (ft-train and Ray)."""
    head = "| figure | before: ft-train | after: ft-train | before: Ray | after: Ray |\n"
    out = head + "|---|---|---|---|---|\n"
    after_rows = {r["figure"]: r for r in rows(after)}
    for r in rows(before):
        a = after_rows.get(r["figure"])
        if a is None:
            continue
        out += f"| {r['figure']} | {r['ft-train']} | {a['ft-train']} | {r['ray']} | {a['ray']} |\n"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, metavar="DIR", help="an earlier checkout")
    p.add_argument("--only", default=",".join(FIGURES), help=f"a subset of {FIGURES}")
    p.add_argument("--full", action="store_true", help="the full series, not --quick")
    args = p.parse_args(argv)
    baseline = os.path.abspath(args.baseline)
    if not os.path.isfile(os.path.join(baseline, "bench", "run.py")):
        p.error(f"--baseline {baseline}: not a checkout of ft-train (no bench/run.py)")
    work = tempfile.mkdtemp(prefix="ft-bench-compare-")
    results = {
        "before": os.path.join(work, "before.json"),
        "after": os.path.join(work, "after.json"),
    }
    trees = [("before", baseline), ("after", REPO)]
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    if {"report", "throughput"} <= set(only):  # one series of runs gives both
        only = [x for x in only if x != "throughput"]
        only[only.index("report")] = "report,throughput"
    for i, figure in enumerate(only):
        for which, tree in trees if i % 2 == 0 else trees[::-1]:
            run_figure(tree, figure, results[which], quick=not args.full)
    print(f"\nresults: {work}\n")
    print(side_by_side(figures_of(results["before"]), figures_of(results["after"])))


if __name__ == "__main__":
    main()
