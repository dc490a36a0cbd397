"""What the Prefect UI shows of a run as it trains (`tasks/live.py`): the progress, the metric
history (bounded, `ft_train.storage.metric_history`) and its plot, the failures table with the
budgets left, and rank tracebacks at WARNING, read back through the session's Prefect API."""

import base64
import contextvars
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
    LogFilter,
    LogFilterFlowRunId,
)

import ft_train
from ft_train import knobs
from tasks.publish import artifact_key
from tests.conftest import on_storage
from tests.helpers import demo_config, fault, train_demo, wait_for

# -- a run, read back through the Prefect API ------------------------------------------------


def artifacts(name: str, what: str, flow_run_id: UUID | None = None) -> list:
    flow_run = ArtifactFilterFlowRunId(any_=[flow_run_id]) if flow_run_id else None
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[artifact_key(name, what)]), flow_run_id=flow_run
            )
        )


def latest(name: str, what: str):
    found = artifacts(name, what)
    assert found, f"no {what} artifact of run {name!r}"
    return max(found, key=lambda a: a.created)


@on_storage("local")
@pytest.mark.usefixtures("prefect_api")
def test_a_run_with_a_restart_shows_its_progress_history_plot_and_failures(
    storage, tmp_path, monkeypatch
):
    """A rank raises at step 7, the group restarts from step 5 and trains on; rank 0 is held
    after step 11 while the test reads the progress shown. At the end the flow run has each artifact,
    the result has the history, and the rank's traceback was logged at WARNING."""
    monkeypatch.setattr(knobs, "UI_UPDATE_EVERY_S", 0.5)  # the tests' runs last seconds
    name, gate = "ui-run", tmp_path / "go-on"
    config = demo_config(
        [fault(tmp_path, 1, 7), {"rank": 0, "step": 11, "kind": "until_file", "path": str(gate)}]
    )
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(
            contextvars.copy_context().run, train_demo, storage, name, config, max_failures=2
        )
        try:
            shown = wait_for(
                lambda: (
                    run.done()
                    or next((a for a in artifacts(name, "progress") if a.data > 90), None)
                ),
                90,
                "the progress at step 11, where the run is held",
            )
            assert not run.done(), run.exception()
            assert shown.description == "report 11 of 12 (total_steps reported)", shown.description
            assert shown.data == pytest.approx(100 * 11 / 12, abs=0.01)
            failures = json.loads(latest(name, "failures").data)  # before the run ends
            assert [(f["kind"], f["rank"], f["step"]) for f in failures] == [("exception", 1, 7)]
        finally:
            gate.touch()
        result = run.result(timeout=120)
    assert result.status == "finished"

    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
        )
    mine = {what: artifacts(name, what, flow_run.id) for what in _KINDS}
    assert {what: len(found) for what, found in mine.items()} == dict.fromkeys(_KINDS, 1), (
        "one artifact of each kind, updated in place"
    )
    assert mine["progress"][0].data == 100.0
    assert mine["progress"][0].description == "finished at report 12"

    history = json.loads(mine["metrics"][0].data)
    assert [p["step"] for p in history] == list(range(1, 13)), "steps 6-7 once: trained again"
    assert all(isinstance(p["loss"], float) for p in history)
    assert [p["step"] for p in result.metrics_history] == list(range(1, 13))
    assert ft_train.TrainResult.from_path(storage.path, name).metrics_history == (
        result.metrics_history
    )

    image = mine["metrics-plot"][0]
    assert image.type == "image" and image.data.startswith("data:image/svg+xml;base64,")
    svg = base64.b64decode(image.data.split(",", 1)[1]).decode()
    assert ">loss<" in svg and "<polyline" in svg and "stroke-dasharray" in svg  # the restart

    failures = mine["failures"][0]
    assert [r["budget left"] for r in json.loads(failures.data)] == [
        "max_failures=2: 1 used, 1 left"
    ]
    assert "max_failures=2: 1 used, 1 left" in failures.description
    assert "max_preemption_failures" in failures.description

    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]))
        )
    # The planned crash: one line at WARNING; its traceback in the failures table instead.
    raised = [g for g in logs if "rank 1 raised after report 7" in g.message]
    assert raised and all(g.level == logging.WARNING for g in raised), raised
    assert all("\n" not in g.message for g in raised), raised
    assert "Traceback" in json.loads(failures.data)[0]["traceback"]


_KINDS = ("progress", "metrics", "metrics-plot", "failures")
