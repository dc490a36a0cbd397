"""`TrainResult`: what a run produced, rebuilt from the run state alone (no Prefect needed).
Unlike a rerun, it reads the whole checkpoint index (the head and its sealed chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import CheckpointConfig
from .errors import StorageError, TrainingFailedError
from .ray_names import RefusesRayNames
from .storage.checkpoint import Checkpoint
from .storage.checkpoint_manager import score
from .storage.fs import Storage
from .storage.metric_history import Point, load_history
from .storage.run_state import FailureRecord, RunState, RunStore


@dataclass
class TrainResult(RefusesRayNames):
    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]]
    path: str
    error: TrainingFailedError | None
    failures: list[FailureRecord] = field(default_factory=list)
    status: str = "running"
    # The reported numeric metrics by step, at a bounded size (`storage.metric_history`).
    metrics_history: list[Point] = field(default_factory=list)

    @property
    def metrics_dataframe(self) -> Any:
        """`metrics_history` as a pandas DataFrame (Ray's name); pandas is not a dependency."""
        try:
            import pandas  # type: ignore[import-untyped]
        except ImportError:
            raise ImportError(
                "TrainResult.metrics_dataframe needs pandas (pip install pandas); "
                "TrainResult.metrics_history holds the same rows as dicts"
            ) from None
        return pandas.DataFrame(self.metrics_history)

    @classmethod
    def from_state(
        cls, storage: Storage, state: RunState, cfg: CheckpointConfig | None = None
    ) -> TrainResult:
        def ckpt(dir_name: str) -> Checkpoint:
            return Checkpoint(storage.uri(f"{state.name}/{dir_name}"), storage.options)

        entries = RunStore(storage, state.name).all_checkpoints(state)
        if cfg is not None and cfg.checkpoint_score_attribute is not None:
            entries.sort(key=lambda e: (score(e, cfg), e.report_index))
        latest = state.latest_entry()
        error = None
        if state.status == "failed":
            error = TrainingFailedError(
                state.error or "failed", [f.model_dump(mode="json") for f in state.failures]
            )
        try:
            history = load_history(storage, state.name).rows()
        except Exception:  # it only informs (damaged, or storage out); the run state is the record
            history = []
        return cls(
            metrics=state.metrics,
            checkpoint=ckpt(latest.dir_name) if latest else None,
            best_checkpoints=[(ckpt(e.dir_name), e.metrics) for e in entries],
            path=storage.uri(state.name),
            error=error,
            failures=list(state.failures),
            status=state.status,
            metrics_history=history,
        )

    @classmethod
    def from_path(
        cls,
        storage_path: str,
        name: str,
        storage_options: dict[str, Any] | None = None,
        checkpoint_config: CheckpointConfig | None = None,
    ) -> TrainResult:
        """The result of the run `name` under `storage_path`, finished or not."""
        from .config import RunConfig

        cfg = RunConfig(name=name, storage_path=storage_path)  # validates and normalises
        storage = Storage(cfg.storage_path, storage_options)
        state = RunStore(storage, name).load()
        if state is None:
            raise StorageError(f"no run named {name!r} under {cfg.storage_path}")
        return cls.from_state(storage, state, checkpoint_config)
