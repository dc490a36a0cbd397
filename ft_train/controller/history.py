"""Keeps the run's metric history (`ft_train.storage.metric_history`) as the controller goes: a
callback, so that the controller's own transitions do not change for it.

Written when a checkpoint commits (at most every `knobs.HISTORY_SAVE_EVERY_S`), when a failure is
recorded, and at the run's end; each write after the run state's and under the run's lease.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import knobs
from ..storage.metric_history import MetricHistory, save_history
from ..storage.run_state import AttemptRecord, CheckpointEntry, FailureRecord, RunState, RunStore
from .callbacks import Callback

logger = logging.getLogger("ft_train")


class HistoryRecorder(Callback):
    def __init__(self, store: RunStore, history: MetricHistory):
        self.store, self.history = store, history
        self._saved_at = time.monotonic()

    def on_attempt_started(self, attempt: AttemptRecord) -> None:
        self.history.restart(attempt.start_report_index)

    def on_report(self, index: int, metrics: dict[str, Any]) -> None:
        self.history.add(index, metrics)

    def on_checkpoint_committed(self, entry: CheckpointEntry | None, state: RunState) -> None:
        if time.monotonic() - self._saved_at >= knobs.HISTORY_SAVE_EVERY_S:
            self.save()

    def on_failure(self, failure: FailureRecord) -> None:
        self.save()

    def on_run_end(self, state: RunState) -> None:
        self.save()

    def save(self) -> None:
        self.store.fence()  # a driver that lost the run leaves the new one's history alone
        try:
            save_history(self.store.storage, self.store.name, self.history)
        except Exception as e:  # a view of the run, outside the commit: never what ends a run
            logger.warning("ft-train: the metric history was not saved (%s)", e)
            return
        self._saved_at = time.monotonic()
