"""MLflow tracking for an ft-train run: `MLflowCallback`, a driver-side `ft_train.UserCallback`.

    RunConfig(callbacks=["ft_train.integrations.mlflow:MLflowCallback"])
    RunConfig(callbacks=[{"callback": "ft_train.integrations.mlflow:MLflowCallback",
                          "kwargs": {"experiment_name": "gpt2-finetune"}}])

One MLflow run per ft-train run, across attempts and driver restarts: it is found again by its
tag `ft_train.run_path` (`{storage_path}/{name}`), in the experiment. What it records:
- the parameters: `train_loop_config`, flattened ("optim.lr"); one changed by a resume with
  `allow_train_loop_change` keeps its first value, and the tag `ft_train.changed_params` names it;
- every number rank 0 reports, at its report index (the MLflow step), each index once: a report
  trained again after a restart (those after the checkpoint it resumed from) is not logged again,
  the tag `ft_train.reports_trained_again` counts them;
- each committed checkpoint as a link: the tag `ft_train.checkpoint.<report index>` holds its URI,
  `ft_train.latest_checkpoint` the latest's;
- each failure: the tag `ft_train.failure.<n>` ("kind on rank r at report s (attempt a): error"),
  `ft_train.failures` their count; a driver's restart: `ft_train.driver_runs`;
- the end: the MLflow run's status (FINISHED, FAILED, or KILLED for a driver stopped, which a
  rerun resumes: the status is RUNNING again), with `ft_train.status` and `ft_train.error`.

The tracking URI: the `tracking_uri` argument, else the driver's MLFLOW_TRACKING_URI, else
MLflow's own default (MLflow 3: `sqlite:///mlflow.db` in the driver's working directory, or
`./mlruns` where that holds data already). Credentials (MLFLOW_TRACKING_TOKEN, ...) come from
the driver's environment, as MLflow reads them. MLflow is imported on the callback's own thread
when it first records, so that the run's start does not wait for it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

from ..callbacks import TrainRunContext, UserCallback, numbers
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..storage.checkpoint import Checkpoint
    from ..storage.run_state import FailureRecord

__all__ = ["MLflowCallback", "RUN_PATH_TAG"]

logger = logging.getLogger("ft_train")

RUN_PATH_TAG = "ft_train.run_path"
_END_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_BAD_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")
_TAG_CHARS = 5000  # below MLflow's limit on a tag's value


class MLflowCallback(UserCallback):
    """Records the run in MLflow (see the module docstring). `tracking_uri`: where, else
    MLFLOW_TRACKING_URI, else MLflow's default; `experiment_name`: which experiment (created if
    missing), else MLFLOW_EXPERIMENT_NAME, else MLflow's "Default"."""

    def __init__(self, tracking_uri: str | None = None, experiment_name: str | None = None):
        if importlib.util.find_spec("mlflow") is None:
            raise ConfigError(
                "MLflowCallback needs MLflow where the flow runs: pip install 'ft-train[mlflow]'"
            )
        # read once, here at the edge: the callback's thread then uses these
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.experiment_name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        self.client: Any = None
        self.run_id: str | None = None
        self.logged_upto = 0  # the highest report index logged
        self.trained_again = 0
        self.failures = 0

    # -- hooks --------------------------------------------------------------------------------

    def after_report(
        self,
        run_context: TrainRunContext,
        metrics: list[dict[str, Any]],
        checkpoint: Checkpoint | None,
        report_index: int = 0,
    ) -> None:
        self._attach(run_context)
        if report_index <= self.logged_upto:
            self.trained_again += 1
            self.client.set_tag(self.run_id, "ft_train.reports_trained_again", self.trained_again)
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        numbers = _numbers(metrics[0] if metrics else {})
        batch = [Metric(k, v, stamp, report_index) for k, v in numbers.items()]
        for i in range(0, len(batch), 1000):  # MLflow's bound on one batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])
        self.logged_upto = report_index

    def after_checkpoint(
        self,
        run_context: TrainRunContext,
        checkpoint: Checkpoint,
        report_index: int,
        metrics: dict[str, Any],
    ) -> None:
        self._attach(run_context)
        self.client.set_tag(self.run_id, f"ft_train.checkpoint.{report_index}", checkpoint.path)
        self.client.set_tag(self.run_id, "ft_train.latest_checkpoint", checkpoint.path)

    def after_failure(
        self, run_context: TrainRunContext, failure: FailureRecord, failures_left: int | None
    ) -> None:
        self._attach(run_context)
        self.failures += 1
        where = f" on rank {failure.rank}" if failure.rank is not None else ""
        text = (
            f"{failure.kind}{where} at report {failure.step} (attempt {failure.attempt}): "
            f"{failure.error}"
        )
        self.client.set_tag(self.run_id, f"ft_train.failure.{self.failures}", text[:_TAG_CHARS])
        self.client.set_tag(self.run_id, "ft_train.failures", self.failures)

    def after_run_end(self, run_context: TrainRunContext, status: str, error: str | None) -> None:
        self._attach(run_context)
        self.client.set_tag(self.run_id, "ft_train.status", status)
        if error:
            self.client.set_tag(self.run_id, "ft_train.error", error[:_TAG_CHARS])
        self.client.set_terminated(self.run_id, _END_STATUS.get(status, "FAILED"))

    # -- the MLflow run -----------------------------------------------------------------------

    def _attach(self, context: TrainRunContext) -> None:
        """Find the ft-train run's MLflow run by its tag, or create it; on the first hook."""
        if self.run_id is not None:
            return
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment_name or "Default"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        quoted = context.path.replace("\\", "\\\\").replace("'", "\\'")
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_PATH_TAG}` = '{quoted}'", max_results=1
        )
        if found:
            run = found[0]
            self.run_id = run.info.run_id
            if run.info.status != "RUNNING":
                client.update_run(self.run_id, status="RUNNING")
            self.logged_upto = _logged_upto(client, self.run_id, run.data.metrics)
            self.trained_again = int(run.data.tags.get("ft_train.reports_trained_again", 0))
            self.failures = int(run.data.tags.get("ft_train.failures", 0))
            logged = run.data.params
        else:
            tags = {RUN_PATH_TAG: context.path, "ft_train.name": context.name}
            self.run_id = client.create_run(
                experiment_id, tags=tags, run_name=context.name
            ).info.run_id
            logged = {}
        self.client = client
        client.set_tag(self.run_id, "ft_train.driver_runs", context.driver_run)
        self._log_params(_flatten(context.train_loop_config), logged)

    def _log_params(self, params: dict[str, str], logged: dict[str, str]) -> None:
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        for i in range(0, len(new), 100):  # MLflow's bound on params in one batch
            self.client.log_batch(self.run_id, params=new[i : i + 100])
        if changed:
            self.client.set_tag(
                self.run_id, "ft_train.changed_params", ", ".join(changed)[:_TAG_CHARS]
            )


def _logged_upto(client: Any, run_id: str, latest: dict[str, float]) -> int:
    """The highest step logged for any metric of the run (one query per metric, once)."""
    steps = [m.step for key in latest for m in client.get_metric_history(run_id, key)]
    return max(steps, default=0)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers among `metrics` (`callbacks.numbers`), under names MLflow takes."""
    return {_BAD_KEY.sub("_", k): v for k, v in numbers(metrics).items()}


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in config.items():
        key = _BAD_KEY.sub("_", f"{prefix}{k}")
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = str(v)[:6000]
    return out
