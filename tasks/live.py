"""What the Prefect UI shows of a run while it trains: four artifacts of the flow run, created at
its first update and then updated in place (one version per flow run, not one per update):

    progress        how far the run is (below), and the report it is at
    metrics         the metric history as a table (`ft_train.storage.metric_history`: at most
                    256 rows, evenly spaced over the run)
    metrics-plot    the same as a line chart per metric, an image artifact (`tasks.plot`)
    failures        each failure with the budget it left; updated at each failure, before the
                    restart, and its description holds every budget left

Progress, in the first of these that the run tells: `total_steps` among the reported metrics
(report rounds done of it); `epoch` among them with `epochs` in `train_loop_config` (epochs done
of it); else no total is known, and the progress stays at 0 with "report N, total unknown" in its
description until the run finishes (100). Progress is updated at most every
`knobs.UI_UPDATE_EVERY_S`, the history and plot every `knobs.UI_HISTORY_EVERY_S` (each update
is an API call on the controller's thread), and all of them at each attempt, failure and end.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeGuard
from uuid import UUID

from prefect import get_client
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
)
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.context import TaskRunContext

from ft_train import knobs
from ft_train.config import name_of
from ft_train.controller import Callback
from ft_train.driver.prepare import RunPlan
from ft_train.policy.failure import preemptions
from ft_train.storage.metric_history import MetricHistory
from ft_train.storage.run_state import AttemptRecord, CheckpointEntry, FailureRecord, RunState
from ft_train.wording import after_report

from . import plot
from .keys import artifact_key

logger = logging.getLogger("ft_train")


def progress(index: int, metrics: dict[str, Any], config: dict[str, Any]) -> tuple[float, str]:
    """(percent, what it counts) for a run at report round `index` that last reported
    `metrics`; percent 0 when no total is known."""
    total, epoch, epochs = metrics.get("total_steps"), metrics.get("epoch"), config.get("epochs")
    if _positive(total):
        return _pct(index, total), f"report {index} of {total:g} (total_steps reported)"
    if _positive(epochs) and isinstance(epoch, (int, float)):
        return _pct(epoch, epochs), f"epoch {epoch:g} of {epochs:g} done, report {index}"
    return 0.0, f"report {index}, total unknown (report total_steps with the metrics to show one)"


def _positive(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _pct(done: float, total: float) -> float:
    return round(max(0.0, min(100.0, 100.0 * done / total)), 2)


class LiveView(Callback):
    """The artifacts are created on the controller's thread (so they belong to the flow run's
    task run of the moment); a report that comes sooner than `knobs.UI_UPDATE_EVERY_S` after the
    last update is shown by a timer at that time, so the view does not stay behind when the
    reports stop (a long evaluation, a hang)."""

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self.ids: dict[str, UUID] = {}
        self._index, self._metrics = plan.state.reports, plan.state.metrics or {}
        self._shown_at = self._history_at = -float("inf")
        self._lock = threading.Lock()  # the controller's thread and the timer's
        self._timer: threading.Timer | None = None

    def on_attempt_started(self, attempt: AttemptRecord) -> None:
        self._index = attempt.start_report_index
        if attempt.attempt > 0:
            self.show_restart(attempt)
        self.refresh()

    def on_report(self, index: int, metrics: dict[str, Any]) -> None:
        self._index, self._metrics = index, metrics
        self._due()

    def on_checkpoint_committed(self, entry: CheckpointEntry | None, state: RunState) -> None:
        self._due()

    def on_failure(self, failure: FailureRecord) -> None:
        self.show_failures()

    def on_run_end(self, state: RunState) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.final()

    def _due(self) -> None:
        wait = self._shown_at + knobs.UI_UPDATE_EVERY_S - time.monotonic()
        if wait <= 0:
            self.refresh(history=False)
        elif self._timer is None:
            run = contextvars.copy_context().run  # the flow run's Prefect settings and client
            self._timer = threading.Timer(wait, run, [self._trailing])
            self._timer.daemon = True
            self._timer.start()

    def _trailing(self) -> None:
        self._timer = None
        try:
            self.refresh(history=False)
        except Exception as e:  # only the UI loses; the next report tries again
            logger.warning("ft-train: the UI's update failed (%s: %s)", type(e).__name__, e)

    def final(self) -> None:
        """Everything, as the run stands now (its end, or a rerun of a finished run)."""
        self._index = self.plan.state.reports  # a finished run's last report, not its checkpoint's
        self._metrics = self.plan.state.metrics or self._metrics
        self.refresh()
        self.show_failures()

    def refresh(self, history: bool = True) -> None:
        """The progress, and the metric history and its plot if `history` or they are due."""
        with self._lock, get_client(sync_client=True) as client:
            self._refresh(client, history)

    def _refresh(self, client: SyncPrefectClient, history: bool) -> None:
        self._shown_at = now = time.monotonic()
        state, name = self.plan.state, self.plan.run_config.name
        pct, what = progress(self._index, self._metrics, self.plan.train_loop_config)
        if state.status == "finished":
            pct, what = 100.0, f"finished at report {state.reports}"
        elif state.status in ("failed", "interrupted"):
            what = f"{state.status} at report {self._index}: {what}"
        self._show(client, "progress", pct, what, create_progress_artifact)
        if not history and now - self._history_at < knobs.UI_HISTORY_EVERY_S:
            return
        self._history_at, kept = now, self.plan.history
        rows = history_rows(kept)
        shown = f"{len(rows)} points" + (f", one every {kept.stride} steps" * (kept.stride > 1))
        description = f"Metric history of run {name!r} ({shown})"
        self._show(client, "metrics", rows, description, create_table_artifact)
        plotted = plot.data_url(kept)
        self._show(
            client, "metrics-plot", plotted, f"Metrics of run {name!r}", create_image_artifact
        )

    def show_restart(self, attempt: AttemptRecord) -> None:
        """Restart `attempt.attempt` (the n-th attempt after the run's first; a retry of the task
        run, or the first attempt of a driver that took the run over) marked where the flow run
        is looked at first: the task run that trains it is renamed `train-N (restart n from
        report S)` (the run's graph and its Task Runs tab), and an artifact of the flow run says
        from where and after what (its Artifacts tab, a mark on the graph; key `...-restarts`,
        a version per restart)."""
        what = restart_title(attempt, self.plan.state)
        context = TaskRunContext.get()
        with self._lock, get_client(sync_client=True) as client:
            if context is not None:  # the task run records its name with each state it sends
                base = context.task_run.name.split(" (restart ")[0]
                context.task_run.name = f"{base} ({what.split(': ')[0].lower()})"
                client.set_task_run_name(context.task_run.id, context.task_run.name)
            create_markdown_artifact(
                restart_markdown(attempt, self.plan),
                key=artifact_key(name_of(self.plan.run_config), "restarts"),
                description=f"{what} of run {self.plan.run_config.name!r}",
            )

    def show_failures(self) -> None:
        state, cfg = self.plan.state, self.plan.run_config.failure_config
        if not state.failures and "failures" not in self.ids and state.status == "running":
            return  # nothing to show yet
        rows = failure_rows(state, cfg.max_failures)
        with self._lock, get_client(sync_client=True) as client:
            self._show(client, "failures", rows, budgets(self.plan), create_table_artifact)

    def _show(
        self,
        client: SyncPrefectClient,
        what: str,
        data: Any,
        description: str,
        create: Callable[..., Any],
    ) -> None:
        key = artifact_key(name_of(self.plan.run_config), what)
        if what not in self.ids:
            self.ids[what] = create(data, key=key, description=description)  # sync: a UUID
            return
        stored = json.dumps(data) if isinstance(data, list) else data  # as `create` stores it
        client.update_artifact(self.ids[what], ArtifactUpdate(data=stored, description=description))


def restart_title(attempt: AttemptRecord, state: RunState) -> str:
    """'Restart n from report S: rank r's exception after report F' (the failure that ended the
    attempt before, where the run state has it)."""
    where = (
        f"from report {attempt.start_report_index}"
        if attempt.start_report_index
        else "from scratch"
    )
    title = f"Restart {attempt.attempt} {where}"
    before = [f for f in state.failures if f.attempt < attempt.attempt]
    if before:
        f = before[-1]
        who = f"rank {f.rank}'s " if f.rank is not None else ""
        at = f" {after_report(f.step)}" if f.step is not None else ""
        title += f": {who}{f.kind}{at}"
    return title


def restart_markdown(attempt: AttemptRecord, plan: RunPlan) -> str:
    """What a restart artifact says: its title, where it started from, and the failure."""
    state, name = plan.state, plan.run_config.name
    restored = attempt.restored_snapshot or attempt.restored_from
    lines = [
        f"# {restart_title(attempt, state)}",
        "",
        f"- **run**: `{name}`, attempt {attempt.attempt} (`{attempt.attempt_id}`)",
        f"- **started**: {attempt.started_at:%Y-%m-%d %H:%M:%S} UTC, {attempt.world_size} ranks",
        f"- **restored**: `{restored}`" if restored else "- **restored**: nothing (from scratch)",
    ]
    before = [f for f in state.failures if f.attempt < attempt.attempt]
    if before and before[-1].error:
        lines.append(f"- **error**: {before[-1].error.splitlines()[0]}")
    lines.append(f"- **failure budgets**: {budgets(plan).split('; ', 1)[-1]}")
    return "\n".join(lines) + "\n"


def failure_rows(state: RunState, max_failures: int) -> list[dict[str, Any]]:
    """Each failure, and what it left of the budget it is charged to."""
    rows, charged, preempted = [], 0, 0
    for i, f in enumerate(state.failures):
        counted = i >= state.budget_start
        if f.kind == "preemption":
            preempted += counted
            left = f"preemptions: {preempted} so far"
        elif f.charged and counted:
            charged += 1
            left = _left("max_failures", charged, max_failures)
        else:
            left = "not charged" if not f.charged else "before a budget reset"
        rows.append(
            {
                "time": f"{f.time:%Y-%m-%d %H:%M:%S} UTC",
                "kind": f.kind,
                "rank": f.rank,
                "step": f.step,
                "attempt": f.attempt,
                "charged": f.charged,
                "budget left": left,
                "error": f.error,
                "traceback": f.traceback,  # the console shows one line; the whole of it is here
            }
        )
    return rows


def budgets(plan: RunPlan) -> str:
    """Every failure budget of the run, and what is left of it."""
    state, cfg = plan.state, plan.run_config.failure_config
    parts = [
        _left("max_failures", state.charged_failures, cfg.max_failures),
        _left("max_preemption_failures", preemptions(state), cfg.max_preemption_failures),
        f"driver runs: {state.driver_runs}",
    ]
    return f"Failures of run {plan.run_config.name!r}; " + "; ".join(parts)


def _left(setting: str, used: int, limit: int) -> str:
    if limit == -1:
        return f"{setting}=-1: {used} used, unlimited"
    return f"{setting}={limit}: {used} used, {max(0, limit - used)} left"


def history_rows(history: MetricHistory) -> list[dict[str, Any]]:
    """The metric history as its table shows it: each point's clock time (`time`, epoch
    seconds in the stored history) as a UTC date and time, NaN as empty."""
    return [
        {k: _utc(v) if k == "time" else _cell(v) for k, v in point.items()}
        for point in history.rows()
    ]


def _utc(epoch_s: Any) -> Any:
    if not isinstance(epoch_s, (int, float)):
        return epoch_s
    return f"{datetime.fromtimestamp(epoch_s, UTC):%Y-%m-%d %H:%M:%S} UTC"


def _cell(value: Any) -> Any:
    return None if isinstance(value, float) and value != value else value
