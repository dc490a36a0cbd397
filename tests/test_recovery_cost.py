"""Progress in reports, one number everywhere, and what each recovery cost (issue 42, items 4
and 6), as a user sees them: `ft-train run` in a child process (the session's Prefect server, a
real local Dask cluster, gloo), its console output, then `ft-train list` and `status --json`,
and the run's Prefect events.

The truth each test checks against is what the run did: rank 0 of `tests.loops.fast_checkpoints`
writes a line as each `report()` returns (`log`): the report, the report it resumed from, the
time. Reports lost = the last report before a failure - the report the next attempt resumed
from; the gap = the first resumed report's time - the last report's before the failure, within
`GAP_TOLERANCE_S` (the driver sees a report a batch after the rank returns from it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore
from tests.helpers import events_of, wait_for

REPO = str(Path(__file__).resolve().parents[1])
GAP_TOLERANCE_S = 1.5
# 20 reports, a checkpoint every 6 and none at the end: the last checkpoint is report 18's.
LOOP = ["--config", "steps=20", "--config", "every=6", "--config", "final_checkpoint=false"]
BAD_PLURALS = re.compile(r"\b1 (failures|reports|steps|ranks|checkpoints|times)\b")


@pytest.fixture
def env(prefect_api, tmp_path) -> dict[str, str]:
    """The child's environment: the session's Prefect API, this repository importable (the
    training function is a test's), no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=prefect_api,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=REPO,
    )
    return env


def cli(env: dict[str, str], *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """`ft-train ARGS`; stdout and stderr together, as a terminal shows them."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def reports_done(log: Path) -> list[tuple[int, int, float]]:
    """(report, resumed from, time) of each report() rank 0 returned from, in order."""
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(int(r), int(f), float(t)) for r, f, t in rows]


def truth(done: list[tuple[int, int, float]], before_from: int, after_from: int) -> tuple:
    """From the run's reports: the failure of the attempt that resumed from `before_from`, then
    the attempt that resumed from `after_from`: (reports before it, reports lost, the gap)."""
    last = max((r for r in done if r[1] == before_from), key=lambda r: r[2])
    first = min((r for r in done if r[1] == after_from), key=lambda r: r[2])
    return last[0], last[0] - after_from, first[2] - last[2]


def check_counts(env, out: str, store: str, name: str, reports: int) -> dict:
    """The same count of reports in the progress bar, `list`, `status --json` and the events;
    returns the `status --json` document."""
    assert re.search(rf"training {name} .* {reports}/{reports} reports ", out), out
    listed = cli(env, "list", "--storage-path", store)
    assert listed.returncode == 0, listed.stdout
    row = next(line for line in listed.stdout.splitlines() if line.startswith(f"{name} "))
    assert re.match(rf"{name} +finished +{reports} ", row), listed.stdout
    status = cli(env, "status", name, "--storage-path", store, "--json")
    assert status.returncode == 0, status.stdout
    doc = json.loads(status.stdout)
    assert doc["reports"] == reports, doc
    assert doc["checkpoints"][-1]["report"] == 18, doc  # the last checkpoint's report
    events = wait_for(
        lambda: [e for e in events_of(name) if e.event == "ft-train.run.finished"],
        30,
        "the run's end event",
    )
    assert events[-1].payload["reports"] == reports, events[-1].payload
    return doc


def check_recoveries(doc: dict, out: str, expected: list[tuple[str, int, int, int, float]]):
    """Each recovery, in `status --json` and in the run's summary: (kind, reports before, the
    report resumed from, reports lost, the true gap)."""
    got = doc["recoveries"]
    assert [(r["kind"], r["reports_before"], r["resumed_from_report"], r["reports_lost"])
            for r in got] == [e[:4] for e in expected], got  # fmt: skip
    for r, (kind, before, start, lost, gap) in zip(got, expected, strict=True):
        assert r["gap"] == "from the last progress to the first resumed report", r
        assert abs(r["gap_s"] - gap) <= GAP_TOLERANCE_S, (r, gap)
        rank = r"on rank \d " if kind != "driver_crash" else ""
        line = (
            rf"{kind} {rank}after report {before} -> 2 ranks resumed from report {start}: "
            rf"{lost} reports? lost, \d+\.\d s from the last progress to the first resumed report"
        )
        assert re.search(line, out), (line, out)


@pytest.mark.parametrize("step_s", [0, 0.1], ids=["few-ms-a-step", "100ms-a-step"])
def test_a_run_counts_reports_alike_everywhere_and_each_worker_failure_costs_what_it_lost(
    env, tmp_path, step_s
):
    """A rank raises after report 9 (the checkpoint is report 6's), then after the restart a
    rank is SIGKILLed after report 15 (the checkpoint is 12's): 3 reports lost each time. The
    run reports 20 times and shows 20 everywhere, though its last checkpoint is report 18's.
    The planned exception is one line at WARNING, not a traceback; a run without in-memory
    snapshots is not told of them; plurals agree."""
    store, name, log = str(tmp_path / "runs"), "counted", tmp_path / "reports.log"
    faults = [
        {"rank": 1, "step": 9, "kind": "raise", "marker": str(tmp_path / "raise")},
        {"rank": 1, "step": 15, "kind": "kill", "marker": str(tmp_path / "kill")},
    ]
    run = cli(
        env, "run", "tests.loops:fast_checkpoints", "--name", name, "--storage-path", store,
        "--workers", "2", "--max-failures", "2", *LOOP, "--config", f"step_s={step_s}",
        "--config", f"log={log}", "--config", f"faults={json.dumps(faults)}",
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out
    assert "Traceback" not in out, out
    warned = [line for line in out.splitlines() if "| WARNING |" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "rank 1 raised after report 9: InjectedFault: injected fault on rank 1 at step 9"
    ), out
    assert "in-memory" not in out and not BAD_PLURALS.search(out), out
    assert "2 failures, at" in out, out

    doc = check_counts(env, out, store, name, 20)
    done = reports_done(log)
    first, second = truth(done, 0, 6), truth(done, 6, 12)
    assert (first[:2], second[:2]) == ((9, 3), (15, 3)), done  # the faults struck where planned
    check_recoveries(
        doc, out, [("exception", 9, 6, 3, first[2]), ("process_death", 15, 12, 3, second[2])]
    )
    (raised, killed) = doc["failures"]
    assert "Traceback" in raised["traceback"], raised  # kept for the failures table and --json


def test_a_driver_killed_three_reports_after_its_checkpoint_costs_three_and_the_wait(env, tmp_path):
    """`ft-train run` is SIGKILLed with its local cluster (as when its machine dies) while rank
    0 holds after report 15 (the last checkpoint is 12's); the same command, run again by hand,
    resumes from report 12. The recovery says 3 reports lost (from the ranks' journals, which
    outlive the kill) and the wall time from report 15 to the first resumed report: the kill,
    the rerun, Prefect's and the cluster's start, not the 0.1 s from the new driver's start."""
    store, name, log = str(tmp_path / "runs"), "crashed", tmp_path / "reports.log"
    hold = {"rank": 0, "step": 15, "kind": "wait", "marker": str(tmp_path / "hold")}
    command = [
        "run", "tests.loops:fast_checkpoints", "--name", name, "--storage-path", store,
        "--workers", "2", *LOOP, "--config", f"log={log}", "--config", f"faults={json.dumps([hold])}",
    ]  # fmt: skip
    with open(tmp_path / "killed.log", "w") as killed_log:
        first = subprocess.Popen(
            [sys.executable, "-m", "cli", *command],
            env=env,
            cwd=REPO,
            stdout=killed_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the driver and its local cluster
        )
    try:
        wait_for(lambda: os.path.exists(hold["marker"]), 240, "rank 0 to hold after report 15")
        store_of = RunStore(Storage(store), name)
        wait_for(
            lambda: (s := store_of.load()) is not None and s.report_index == 12,
            60,
            "the checkpoint of report 12 to be committed",
        )
        os.killpg(first.pid, signal.SIGKILL)
        assert first.wait(timeout=60) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    assert store_of.load().reports == 12  # what the killed driver had saved: not the truth

    again = cli(env, *command)
    out = again.stdout
    assert again.returncode == 0, out
    assert "Traceback" not in out and not BAD_PLURALS.search(out), out
    doc = check_counts(env, out, store, name, 20)
    before, lost, gap = truth(reports_done(log), 0, 12)
    assert (before, lost) == (15, 3)
    check_recoveries(doc, out, [("driver_crash", 15, 12, 3, gap)])
