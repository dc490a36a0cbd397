"""What a training run shows in Prefect beyond its logs: events as it goes, artifacts at its end.

Events, on the resource `ft-train.run.{name}` (related to the flow run that emits them), each as
soon as the driver has recorded what it tells of (controller callbacks). An automation can act on them: a notification
on a failure, a run that starts when another finishes.

    ft-train.checkpoint.committed   a checkpoint is committed: reports, metrics, path
    ft-train.failure                a failure is recorded: kind, rank, step, reports, error, charged
    ft-train.run.restarted          an attempt after the first started (a retry of the task
                                    run, or a driver's takeover): attempt, step, restored, ranks
    ft-train.run.finished           the run ended: status, reports, metrics, path
    ft-train.run.failed             (and error, for a failed one)

Counts are in reports (DESIGN.md's vocabulary), the number `ft-train list` shows: `reports` is
the run's progress (`RunState.reports`; a failure's: the newest round every rank had made).
`step`, the name these fields had before, stays in each payload with the same number (a
failure's `step` is its rank's own report count), for automations written against it.

Artifacts, at the end of a flow run that finished or failed (not one interrupted): a table of
the run's checkpoints with their metrics (the newest `MAX_ROWS`) and a summary. Those kept
current while the run trains (progress, metric history and plot, failures) are
`tasks/live.py`'s. Their keys name the run, so the Artifacts page keeps each run's history
across the flow runs that trained it (a rerun after a driver crash adds a version).
"""

from __future__ import annotations

import json
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

from ft_train.config import name_of
from ft_train.controller import Callback
from ft_train.driver.prepare import RunPlan
from ft_train.storage.run_state import AttemptRecord, CheckpointEntry, FailureRecord, RunState

from .keys import artifact_key
from .live import LiveView

MAX_ROWS = 200  # checkpoints in the table; all of them are in `ft-train status` and the result


class RunEvents(Callback):
    """Emits an event for each checkpoint the controller commits, each failure it records, and
    the run's end (a controller callback)."""

    def __init__(self, plan: RunPlan):
        self.plan = plan

    def _emit(self, event: str, payload: dict[str, Any]) -> None:
        name = name_of(self.plan.run_config)
        resource = {"prefect.resource.id": f"ft-train.run.{name}", "prefect.resource.name": name}
        emit_event(event=f"ft-train.{event}", resource=resource, payload=_json(payload))

    def on_attempt_started(self, attempt: AttemptRecord) -> None:
        if attempt.attempt == 0:
            return  # the run's first: its flow run's start says it
        self._emit(
            "run.restarted",
            {
                "attempt": attempt.attempt,
                "step": attempt.start_report_index,
                # a checkpoint's directory, or an in-memory snapshot; None: from scratch
                "restored": attempt.restored_snapshot or attempt.restored_from,
                "ranks": attempt.world_size,
            },
        )

    def on_failure(self, failure: FailureRecord) -> None:
        self._emit("failure", failure.model_dump(mode="json", exclude={"time", "traceback"}))

    def on_checkpoint_committed(self, entry: CheckpointEntry | None, state: RunState) -> None:
        self._emit(
            "checkpoint.committed",
            {
                "reports": state.reports,
                "step": state.reports,
                "metrics": entry.metrics if entry else {},
                "path": self.plan.storage.uri(f"{state.name}/{state.latest}"),
            },
        )

    def on_run_end(self, state: RunState) -> None:
        if state.status not in ("finished", "failed"):
            return  # interrupted: the next flow run goes on with it
        payload: dict[str, Any] = {
            "status": state.status,
            "reports": state.reports,
            "step": state.reports,
            "metrics": state.metrics or {},
            "path": self.plan.storage.uri(state.name),
        }
        if state.status == "failed":
            payload["error"] = state.error
        self._emit(f"run.{state.status}", payload)


def publish_artifacts(plan: RunPlan, entries: list[CheckpointEntry], view: LiveView) -> None:
    """The run's checkpoint table (`entries`: every retained checkpoint, as
    `RunStore.all_checkpoints` read them) and summary, and the live view's artifacts brought up
    to date (`view`, which kept them while the run trained, or a new one over the history read
    at the run's end), as artifacts of this flow run. Reads no storage."""
    view.final()
    state = plan.state
    name = state.name
    rows = [
        {
            "step": e.report_index,
            "checkpoint": plan.storage.uri(f"{name}/{e.dir_name}"),
            "attempt": e.attempt,
            "committed_at": f"{e.committed_at:%Y-%m-%d %H:%M:%S} UTC",
            **{k: _cell(v) for k, v in e.metrics.items()},
        }
        for e in entries[-MAX_ROWS:]
    ]
    shown = "" if len(entries) <= MAX_ROWS else f" (the newest {MAX_ROWS} of {len(entries)})"
    create_table_artifact(
        rows,
        key=artifact_key(name, "checkpoints"),
        description=f"Checkpoints of run {name!r}{shown}",
    )
    create_markdown_artifact(
        _summary(plan, state, len(entries)),
        key=artifact_key(name, "summary"),
        description=f"Run {name!r}",
    )


def _summary(plan: RunPlan, state: RunState, kept: int) -> str:
    metrics = state.metrics or {}
    charged = sum(f.charged for f in state.failures)
    lines = [
        f"# Run `{state.name}`: {state.status}",
        "",
        f"- **path**: `{plan.storage.uri(state.name)}`",
        f"- **reports**: {state.reports}",
        f"- **checkpoints kept**: {kept}" + (f", latest `{state.latest}`" if state.latest else ""),
        f"- **failures**: {len(state.failures)} ({charged} charged to max_failures="
        f"{plan.run_config.failure_config.max_failures})",
        f"- **driver runs**: {state.driver_runs}",
        f"- **metrics**: `{json.dumps(_json(metrics), sort_keys=True)}`",
    ]
    if state.error:
        lines.append(f"- **error**: {state.error.splitlines()[0]}")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> Any:
    return (
        value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
    )


def _json(value: Any) -> Any:
    """`value` as JSON would carry it (metrics may hold anything a rank reported)."""
    return json.loads(json.dumps(value, default=str))
