"""TensorBoard event files for an ft-train run: `TensorBoardCallback`, a driver-side
`ft_train.UserCallback`.

    RunConfig(callbacks=[{"callback": "ft_train.integrations.tensorboard:TensorBoardCallback",
                          "kwargs": {"log_dir": "/shared/tb"}}])

Events go under `{log_dir}/{run name}` (`tensorboard --logdir {log_dir}` shows each run by its
name): every number rank 0 reports as a scalar at its report index (the step), each index once
across attempts and driver restarts (a driver reads the directory's event files when it first
writes, and skips the indices they hold); committed checkpoints, failures and the end as text.
A report trained again after a restart is not written again. `log_dir` is a path on the driver's
machine, or any URL TensorBoard's writer takes (s3://, gs://).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from ..callbacks import TrainRunContext, UserCallback, numbers
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..storage.checkpoint import Checkpoint
    from ..storage.run_state import FailureRecord

__all__ = ["TensorBoardCallback"]


class TensorBoardCallback(UserCallback):
    """Writes the run's reports to TensorBoard event files under `{log_dir}/{run name}`."""

    def __init__(self, log_dir: str):
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "TensorBoardCallback needs TensorBoard where the flow runs: pip install "
                "'ft-train[tensorboard]'"
            )
        if not log_dir:
            raise ConfigError("TensorBoardCallback(log_dir=...): give the directory to write to")
        self.log_dir = log_dir if "://" in log_dir else os.path.abspath(log_dir)
        self.writer: Any = None
        self.written_upto = 0  # the highest report index in the run's event files

    def after_report(
        self,
        run_context: TrainRunContext,
        metrics: list[dict[str, Any]],
        checkpoint: Checkpoint | None,
        report_index: int = 0,
    ) -> None:
        self._open(run_context)
        if report_index <= self.written_upto:
            return  # trained again after a restart: written once already
        for key, value in numbers(metrics[0] if metrics else {}).items():
            self.writer.add_scalar(key, value, global_step=report_index)
        self.written_upto = report_index
        if checkpoint is not None:
            # on disk with the checkpoint: a restart resumes after this report and never
            # reports it again, so a driver killed now must not lose it
            self.writer.flush()

    def after_checkpoint(
        self,
        run_context: TrainRunContext,
        checkpoint: Checkpoint,
        report_index: int,
        metrics: dict[str, Any],
    ) -> None:
        self._open(run_context)
        self._text("ft_train/checkpoint", f"report {report_index}: {checkpoint.path}")

    def after_failure(
        self, run_context: TrainRunContext, failure: FailureRecord, failures_left: int | None
    ) -> None:
        self._open(run_context)
        where = f" on rank {failure.rank}" if failure.rank is not None else ""
        text = (
            f"{failure.kind}{where} at report {failure.step} (attempt {failure.attempt}): "
            f"{failure.error}"
        )
        self._text("ft_train/failure", text)
        self.writer.flush()

    def after_run_end(self, run_context: TrainRunContext, status: str, error: str | None) -> None:
        self._open(run_context)
        text = status + (f": {error}" if error else "")
        self._text("ft_train/end", text)
        self.writer.close()
        self.writer = None

    def _text(self, tag: str, text: str) -> None:
        # At the latest step written, never an earlier one: TensorBoard's reader takes an event
        # at an earlier step for a restart's, and drops every scalar after it.
        self.writer.add_text(tag, text, global_step=self.written_upto)

    def _open(self, context: TrainRunContext) -> None:
        if self.writer is not None:
            return
        from torch.utils.tensorboard import SummaryWriter

        where = f"{self.log_dir.rstrip('/')}/{context.name}"
        self.written_upto = max(self.written_upto, _written_upto(where))
        self.writer = SummaryWriter(log_dir=where, flush_secs=10)


def _written_upto(directory: str) -> int:
    """The highest step of any scalar in `directory`'s event files (0 for none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if "://" not in directory and not os.path.isdir(directory):
        return 0
    accumulator = EventAccumulator(
        directory, size_guidance={"scalars": 0}, purge_orphaned_data=False
    )
    accumulator.Reload()
    return max(
        (e.step for tag in accumulator.Tags()["scalars"] for e in accumulator.Scalars(tag)),
        default=0,
    )
