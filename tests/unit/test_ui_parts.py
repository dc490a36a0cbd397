"""What the Prefect UI shows of a run, its parts alone (`tasks/live.py`, `tasks/plot.py`,
`tasks/keys.py`): the bounded metric history and its plot, the metrics table's times, the
progress, the failures table, a restart's title, and the artifact keys. No Prefect API: the
run's own view is checked in `tests/test_ui.py` and, in a browser, `tests/test_ui_screenshot.py`.
"""

from datetime import UTC, datetime

import pytest

from ft_train.controller.history import HistoryRecorder
from ft_train.errors import RunLockedError
from ft_train.storage.fs import Storage
from ft_train.storage.metric_history import MAX_POINTS, MAX_SERIES, MetricHistory, load_history
from ft_train.storage.run_state import AttemptRecord, FailureRecord, RunState, RunStore
from tasks import plot
from tasks.keys import artifact_key
from tasks.live import failure_rows, history_rows, progress, restart_title


def test_the_history_stays_bounded_and_spread_over_the_whole_run():
    history = MetricHistory()
    metrics = {f"m{i}": float(i) for i in range(MAX_SERIES + 4)} | {"note": "text", "ok": True}
    for step in range(1, 100_001):
        history.add(step, {**metrics, "loss": 1.0 / step})
    steps = [p["step"] for p in history.points]
    assert MAX_POINTS // 2 <= len(steps) <= MAX_POINTS, len(steps)
    assert steps[-1] == 100_000 and steps[0] <= history.stride, steps[:3]
    gaps = {b - a for a, b in zip(steps[:-1], steps[1:], strict=True)}
    assert gaps <= {history.stride, 100_000 % history.stride or history.stride}, gaps
    assert history.series == [f"m{i}" for i in range(MAX_SERIES)]  # bools, text, extras: out
    assert len(history.model_dump_json()) < 100_000


def test_a_restart_drops_the_rounds_trained_again_and_is_marked():
    history = MetricHistory()
    for step in range(1, 13):
        history.add(step, {"loss": float(step)})
    history.restart(5)
    assert [p["step"] for p in history.points] == [1, 2, 3, 4, 5]
    assert history.restarts == [5]
    svg = plot.svg(history)
    assert "stroke-dasharray" in svg and ">loss<" in svg


def test_the_history_is_written_beside_the_run_state_only_by_the_lease_holder(tmp_path):
    store = RunStore(Storage(str(tmp_path)), "r")
    recorder = HistoryRecorder(store, MetricHistory())
    recorder.on_report(1, {"loss": 0.5})
    recorder.on_run_end(RunState(name="r"))
    assert load_history(store.storage, "r").points[0]["loss"] == 0.5

    class Lost:
        def check(self):
            raise RunLockedError("another driver holds run 'r'")

    store.lease = Lost()
    recorder.on_report(2, {"loss": 0.25})
    with pytest.raises(RunLockedError):
        recorder.on_run_end(RunState(name="r"))
    assert len(load_history(store.storage, "r").points) == 1, "the new driver's history kept"


def test_progress_comes_from_total_steps_then_epochs_else_says_the_total_is_unknown():
    assert progress(30, {"total_steps": 120}, {}) == (
        25.0,
        "report 30 of 120 (total_steps reported)",
    )
    pct, what = progress(30, {"epoch": 1}, {"epochs": 4})
    assert pct == 25.0 and "epoch 1 of 4" in what
    pct, what = progress(30, {"loss": 0.1}, {"epochs": "many"})
    assert pct == 0.0 and "total unknown" in what and "total_steps" in what


def test_the_failures_table_shows_what_each_failure_left_of_its_budget():
    state = RunState(
        name="r",
        failures=[
            FailureRecord(kind="exception", rank=1, step=7),
            FailureRecord(kind="driver_crash", charged=False),
            FailureRecord(kind="process_death", rank=0, step=9),
        ],
    )
    left = [r["budget left"] for r in failure_rows(state, max_failures=3)]
    assert left == [
        "max_failures=3: 1 used, 2 left",
        "not charged",
        "max_failures=3: 2 used, 1 left",
    ]


def test_only_metrics_are_plotted_not_where_a_run_resumed_nor_clock_times():
    history = MetricHistory()
    for step in range(1, 6):
        metrics = {"loss": 1.0 / step, "resumed_from": 3, "epoch": 0, "total_steps": 5}
        history.add(step, metrics | {"timestamp": 1.8e9 + step, "step_time": 0.1})
    assert plot.charted(history) == ["loss", "step_time"]
    svg = plot.svg(history)
    assert ">loss<" in svg and ">resumed_from<" not in svg and ">timestamp<" not in svg


def test_the_metrics_table_shows_utc_times_not_epoch_seconds():
    history = MetricHistory()
    at = datetime(2026, 12, 7, 6, 55, 22, tzinfo=UTC).timestamp()
    history.add(1, {"loss": 0.5}, at=at)
    history.add(2, {"loss": float("nan")}, at=at + 61)
    rows = history_rows(history)
    assert [r["time"] for r in rows] == ["2026-12-07 06:55:22 UTC", "2026-12-07 06:56:23 UTC"]
    assert rows[0]["loss"] == 0.5 and rows[1]["loss"] is None


def test_a_restart_is_titled_with_where_it_started_and_the_failure_before_it():
    state = RunState(name="r", failures=[FailureRecord(kind="exception", rank=1, step=7)])
    attempt = AttemptRecord(attempt=1, attempt_id="a1", world_size=2, start_report_index=5)
    assert (
        restart_title(attempt, state)
        == "Restart 1 from report 5: rank 1's exception after report 7"
    )
    state = RunState(name="r", failures=[FailureRecord(kind="driver_crash", charged=False)])
    attempt = AttemptRecord(attempt=2, attempt_id="a2", world_size=2)
    assert restart_title(attempt, state) == "Restart 2 from scratch: driver_crash"


def test_artifact_keys_are_the_run_name_where_prefect_takes_it_else_a_slug_and_a_hash():
    assert artifact_key("demo", "progress") == "demo-progress"
    assert artifact_key("nightly-2026-12-07", "metrics-plot") == "nightly-2026-12-07-metrics-plot"
    key = artifact_key("unique_run_id=da823d5", "checkpoints")
    assert key.startswith("unique-run-id-da823d5-") and key.endswith("-checkpoints"), key
    assert len(key) == len("unique-run-id-da823d5-") + 8 + len("-checkpoints"), key
    assert artifact_key("Run.A", "failures") != artifact_key("run-a", "failures")
    assert artifact_key("run-a", "failures") == "run-a-failures"
    for name in ["a", "A" * 200, "a" * 200, "exp-1.2_b+c,d@e:f", "---", "-a", "a--b"]:
        key = artifact_key(name, "summary")
        assert key == key.lower() and set(key) <= set("abcdefghijklmnopqrstuvwxyz0123456789-"), key
        assert len(key) < 100 and "--" not in key and not key.startswith("-"), key
