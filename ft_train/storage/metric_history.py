"""The run's metric history: the numbers its ranks reported, by step, at a bounded size, in
`{storage_path}/{name}/metrics_history.json` beside the run state (`TrainResult.metrics_history`,
the UI's plot).

Bounded whatever the run's length: at most `MAX_POINTS` points of at most `MAX_SERIES` numeric
metrics each (the first names seen; bools and non-numbers are left out), so the file stays under
about 100 kB. When the points would exceed the bound, every other one is dropped and the stride
doubles: the kept points stay evenly spaced over the whole run (each at a step that is a
multiple of `stride`), and the newest point is always kept as well.

A restart from a checkpoint drops the points past the checkpoint's step: those rounds are trained
again, and the history shows the run that counts. The steps where an attempt restarted are kept
(`restarts`, the newest `MAX_RESTARTS`).

Not part of the commit protocol: the run state never references this file, it is written whole
(`write_atomic`) after the run state it follows, and a crash that loses its last write loses
only points that a rerun reports again. A rerun reads it once (invariant 5 holds: one bounded
read). It holds metrics only: no config, no credential.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import StorageError
from .fs import Storage

HISTORY_FILE = "metrics_history.json"
MAX_POINTS = 256
MAX_SERIES = 16
MAX_RESTARTS = 64
Point = dict[str, float | int | None]  # "step", "time" (epoch s), then the metrics


class MetricHistory(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_version: int = 1
    stride: int = Field(1, ge=1)
    series: list[str] = Field(default_factory=list)  # the metric names kept, first seen first
    points: list[Point] = Field(default_factory=list)
    restarts: list[int] = Field(default_factory=list)  # steps an attempt restarted from

    def add(self, step: int, metrics: dict[str, Any], at: float | None = None) -> None:
        """Record round `step`'s metrics (its numeric ones)."""
        values = {k: v for k, v in metrics.items() if _number(v)}
        for name in values:
            if name not in self.series and len(self.series) < MAX_SERIES:
                self.series.append(name)
        point: Point = {"step": step, "time": round(time.time() if at is None else at, 3)}
        point.update({k: _finite(values[k]) for k in self.series if k in values})
        if self.points and self._is_tail(self.points[-1]):
            self.points.pop()  # the previous newest, off the stride: replaced by this one
        self.points.append(point)
        if len(self.points) > MAX_POINTS:
            self.stride *= 2
            newest = self.points[-1]
            kept = [p for p in self.points[:-1] if not self._is_tail(p)]
            self.points = kept + [newest]

    def restart(self, step: int) -> None:
        """An attempt starts from step `step`: the points after it will be reported again."""
        self.points = [p for p in self.points if _step(p) <= step]
        if step > 0 or self.restarts:
            self.restarts = (self.restarts + [step])[-MAX_RESTARTS:]

    def rows(self) -> list[Point]:
        return [dict(p) for p in self.points]

    def _is_tail(self, point: Point) -> bool:
        return _step(point) % self.stride != 0


def _step(point: Point) -> int:
    return int(point.get("step") or 0)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: float | int) -> float | int | None:
    return value if isinstance(value, int) or math.isfinite(value) else None


def history_path(name: str) -> str:
    return f"{name}/{HISTORY_FILE}"


def load_history(storage: Storage, name: str) -> MetricHistory:
    """The run's history, empty for a new run (or one stored before histories were kept)."""
    path = history_path(name)
    raw = storage.read_bytes(path)
    if raw is None:
        return MetricHistory()
    try:
        return MetricHistory.model_validate_json(raw)
    except ValidationError as e:
        raise StorageError(
            f"{storage.uri(path)} is not a metric history ({e.errors()[0]['msg']}); delete the "
            "file to start the run's history afresh"
        ) from None


def save_history(storage: Storage, name: str, history: MetricHistory) -> None:
    """Written whole: readers see the old history or the new. The caller fences the write."""
    storage.write_atomic(history_path(name), history.model_dump_json().encode())
