"""What the controller tells its subscribers as it goes (the Prefect adapter's events and UI,
`tasks/publish.py`). A callback that fails is logged and ignored: the run's own outcome never
depends on who watches it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..storage.run_state import AttemptRecord, CheckpointEntry, FailureRecord, RunState

logger = logging.getLogger("ft_train")


class Callback:
    """Override what you need; each is called on the controller's thread, after the run state
    records what it tells of."""

    def on_attempt_started(self, attempt: AttemptRecord) -> None:
        pass

    def on_report(self, index: int, metrics: dict[str, Any]) -> None:
        """Every rank reported round `index` (called for each round: keep it cheap)."""

    def on_checkpoint_committed(self, entry: CheckpointEntry | None, state: RunState) -> None:
        pass

    def on_round_done(
        self, index: int, rank_metrics: list[dict[str, Any]], entry: CheckpointEntry | None
    ) -> None:
        """Round `index` is handled: every rank's metrics (rank order) and the checkpoint it
        committed, or None (after `on_report`, and `on_checkpoint_committed` if it has one)."""

    def on_failure(self, failure: FailureRecord) -> None:
        pass

    def on_run_end(self, state: RunState) -> None:
        pass


def notify(callbacks: Sequence[Callback], hook: str, *args: Any) -> None:
    for callback in callbacks:
        try:
            getattr(callback, hook)(*args)
        except Exception as e:  # watching the run must not change it
            logger.warning(
                "ft-train: %s.%s failed (%s: %s)",
                type(callback).__name__,
                hook,
                type(e).__name__,
                e,
            )
