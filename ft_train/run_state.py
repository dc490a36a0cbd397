"""The run-state document: everything a rerun needs, in one JSON object at
`{storage_path}/{name}/run_state.json`.

It holds the committed checkpoints with their metrics, the report index, the failure history, the
attempts, a config fingerprint and the status. No pickles, no user code: a run stays readable by
any later ft-train (unknown fields are ignored, missing ones take defaults; a document from a
newer schema is refused with a clear error). A rerun reads this one object and nothing else
(storage invariant 5).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import StorageError
from .storage import Storage

SCHEMA_VERSION = 1
STATE_FILE = "run_state.json"

FailureKind = Literal[
    "exception",  # the training function raised on a rank
    "process_death",  # a rank's worker process died (SIGKILL, OOM, os._exit)
    "node_loss",  # the scheduler removed a rank's worker
    "preemption",
    "hang",
    "driver_interrupt",  # Ctrl+C / SIGTERM of the flow process: not charged
    "driver_crash",  # the previous driver vanished (SIGKILL): not charged
]
RunStatus = Literal["running", "finished", "failed", "interrupted"]


def now() -> datetime:
    return datetime.now(timezone.utc)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FailureRecord(_Doc):
    kind: FailureKind
    rank: Optional[int] = None
    step: Optional[int] = None  # the rank's report index when it failed
    error: str = ""
    time: datetime = Field(default_factory=now)
    attempt: int = 0
    charged: bool = True  # counts toward max_failures


class CheckpointEntry(_Doc):
    dir_name: str
    report_index: int
    metrics: dict[str, Any] = Field(default_factory=dict)
    attempt: int = 0
    committed_at: datetime = Field(default_factory=now)


class AttemptRecord(_Doc):
    attempt: int
    attempt_id: str
    world_size: int
    restored_from: Optional[str] = None  # checkpoint dir_name, None on a fresh start
    start_report_index: int = 0
    started_at: datetime = Field(default_factory=now)


class RunState(_Doc):
    schema_version: int = SCHEMA_VERSION
    name: str
    status: RunStatus = "running"
    config_fingerprint: str = ""
    report_index: int = 0  # report rounds covered by the latest committed checkpoint
    checkpoints: list[CheckpointEntry] = Field(default_factory=list)  # retained, commit order
    latest: Optional[str] = None
    failures: list[FailureRecord] = Field(default_factory=list)
    budget_start: int = 0  # failures before this index do not count toward max_failures
    attempts: list[AttemptRecord] = Field(default_factory=list)
    driver_runs: int = 0
    final_metrics: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    created_at: datetime = Field(default_factory=now)
    updated_at: datetime = Field(default_factory=now)

    @property
    def charged_failures(self) -> int:
        return sum(f.charged for f in self.failures[self.budget_start :])

    def latest_entry(self) -> Optional[CheckpointEntry]:
        return next((c for c in self.checkpoints if c.dir_name == self.latest), None)


def fingerprint(**parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class RunStore:
    """Reads and writes one run's state document."""

    def __init__(self, storage: Storage, name: str):
        self.storage, self.name = storage, name
        self.path = f"{name}/{STATE_FILE}"

    def load(self) -> Optional[RunState]:
        raw = self.storage.read_bytes(self.path)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise StorageError(
                f"{self.storage.uri(self.path)} is not valid JSON ({e}); the run directory is "
                "damaged: restore the file, or start a new run with another run_config.name"
            ) from None
        if not isinstance(doc, dict):
            raise StorageError(f"{self.storage.uri(self.path)} is not a run state (not an object)")
        version = doc.get("schema_version", 0)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise StorageError(
                f"{self.storage.uri(self.path)} has schema_version {version!r}; this ft-train "
                f"reads up to {SCHEMA_VERSION}: upgrade ft-train to resume this run"
            )
        try:
            return RunState.model_validate(doc)
        except ValidationError as e:
            raise StorageError(f"{self.storage.uri(self.path)} is not a run state: {e}") from None

    def save(self, state: RunState) -> None:
        state.updated_at = now()
        self.storage.write_atomic(self.path, state.model_dump_json(indent=1).encode())
