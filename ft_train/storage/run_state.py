"""The run-state document: everything a rerun needs, in one JSON object at
`{storage_path}/{name}/run_state.json` (the head), plus the sealed checkpoint index.

The head holds the newest committed checkpoints with their metrics, the report index, the failure
history, the attempts, the config the run last trained with (and its fingerprint: all that runs
stored before the config itself record; `ft_train.driver.resume`) and the status. No pickles, no user code: a run stays
readable by any later ft-train (unknown fields are ignored, missing ones take defaults; a document
from a newer schema is refused with a clear error). A rerun reads the head and nothing else
(storage invariant 5), so its cost does not grow with the run's history.

The sealed index: with `num_to_keep=None` every checkpoint is kept forever, so the head would
grow without bound. Once it holds more than `INDEX_CHUNK` entries, the oldest `INDEX_CHUNK` move
into an immutable chunk `{name}/checkpoint_index/{k:06d}.json` and the head counts the chunks
(`sealed_chunks`). Only code that needs every checkpoint (results, status, orphan collection)
reads the chunks, through `RunStore.all_checkpoints`.

Schema history: 1 kept every retained checkpoint in the head; 2 added `sealed_chunks`. A schema-1
document reads as one with no sealed chunks. Version 2 is written so that an ft-train that reads
only schema 1 refuses the run instead of seeing the head's checkpoints as all of them (it would
drop the chunk count on its next write and then delete the sealed checkpoints as orphans).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .. import knobs
from ..errors import StorageError
from .fs import Storage, unreachable

logger = logging.getLogger("ft_train")

SCHEMA_VERSION = 2
STATE_FILE = "run_state.json"
INDEX_DIR = "checkpoint_index"
# Entries per sealed chunk, and with num_to_keep=None the head's bound: a rerun reads and
# writes back a head of at most this many entries, whatever the run's length.
INDEX_CHUNK = 128


class FailureKind(enum.StrEnum):
    """What ended an attempt (`FailureRecord.kind`). A str enum, stored as its value: the run
    states written when kinds were plain strings read back as members, and a member compares
    equal to its string."""

    EXCEPTION = "exception"  # the training function raised on a rank
    PROCESS_DEATH = "process_death"  # a rank's worker process died (SIGKILL, OOM, os._exit)
    NODE_LOSS = "node_loss"  # the scheduler removed a rank's worker
    PREEMPTION = "preemption"  # its workers were told to leave: charged to its own budget
    HANG = "hang"  # no report() within hang_timeout_s, or the rank a collective waited for
    DRIVER_INTERRUPT = "driver_interrupt"  # Ctrl+C / SIGTERM of the flow process: not charged
    DRIVER_CRASH = "driver_crash"  # the previous driver vanished (SIGKILL): not charged


RunStatus = Literal["running", "finished", "failed", "interrupted"]


def now() -> datetime:
    return datetime.now(UTC)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore")


# The end of a rank's traceback that a failure record keeps: enough for the frames that raised,
# and a run that fails often (max_failures=-1) keeps a run state of bounded growth.
TRACEBACK_CHARS = 4000


class FailureRecord(_Doc):
    kind: FailureKind
    rank: int | None = None
    step: int | None = None  # the rank's report index when it failed
    # The run's progress when it failed: the newest report round every rank had made, and when
    # that round reached the driver (for a driver crash: when the ranks' journals last moved).
    # What a recovery cost is counted from these (`reports_lost`, `recovery_gap_s`); None in
    # records stored before they were kept, or where nothing tells.
    reports: int | None = None
    last_report_at: datetime | None = None
    error: str = ""
    time: datetime = Field(default_factory=now)
    attempt: int = 0
    charged: bool = True  # counts toward max_failures
    # The rank's traceback text, where it raised (its last TRACEBACK_CHARS): what
    # `WorkerGroupError.worker_failures` rebuilds the exception from.
    traceback: str = ""

    @field_validator("traceback")
    @classmethod
    def _bounded(cls, text: str) -> str:
        return text[-TRACEBACK_CHARS:]


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
    restored_from: str | None = None  # checkpoint dir_name, None on a fresh start
    start_report_index: int = 0
    started_at: datetime = Field(default_factory=now)
    restored_snapshot: str | None = None  # an in-memory snapshot round newer than restored_from
    # When the attempt's first report round reached the driver: the end of a recovery's gap.
    first_report_at: datetime | None = None


class RunState(_Doc):
    schema_version: int = SCHEMA_VERSION
    name: str
    status: RunStatus = "running"
    config_fingerprint: str = ""
    # The config the run last trained with (`ft_train.driver.resume.config_doc`); None if stored before.
    config: dict[str, Any] | None = None
    report_index: int = 0  # report rounds covered by the latest committed checkpoint
    # The run's progress, in reports (DESIGN.md's vocabulary): the newest report round every
    # rank made, as of the last save. A finished run's is its last report (a run that reported
    # 20 times, its last checkpoint at report 18, has 20); a restart sets it back to the round
    # it resumes from. What `ft-train list`, `status --json`, the progress bar and the events show.
    reports: int = 0
    # The newest retained checkpoints, commit order. Older ones are in the sealed chunks.
    checkpoints: list[CheckpointEntry] = Field(default_factory=list)
    sealed_chunks: int = Field(0, ge=0)  # chunks 0..sealed_chunks-1 hold the ones before these
    latest: str | None = None
    failures: list[FailureRecord] = Field(default_factory=list)
    budget_start: int = 0  # failures before this index do not count toward max_failures
    attempts: list[AttemptRecord] = Field(default_factory=list)
    driver_runs: int = 0
    final_metrics: dict[str, Any] | None = None
    error: str | None = None
    # The class of the error the run failed with (e.g. "WorkerGroupError"), so that a result read
    # back from storage raises the same kind; None: a TrainingFailedError.
    error_type: str | None = None
    created_at: datetime = Field(default_factory=now)
    updated_at: datetime = Field(default_factory=now)

    @model_validator(mode="after")
    def _at_least_the_checkpoint(self) -> RunState:
        # Runs stored before `reports` was kept: their latest checkpoint's round is all we know.
        self.reports = max(self.reports, self.report_index)
        return self

    @property
    def charged_failures(self) -> int:
        return sum(f.charged for f in self.failures[self.budget_start :])

    def latest_entry(self) -> CheckpointEntry | None:
        """The latest checkpoint's entry: always in the head (the last one committed)."""
        return next((c for c in self.checkpoints if c.dir_name == self.latest), None)

    @property
    def metrics(self) -> dict[str, Any] | None:
        """The run's metrics: the last report of a finished run, else its latest checkpoint's."""
        latest = self.latest_entry()
        return self.final_metrics or (latest.metrics if latest else None)


class IndexChunk(_Doc):
    """One sealed chunk of the checkpoint index: written once, never changed."""

    checkpoints: list[CheckpointEntry]


def fingerprint(**parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class Fence(Protocol):
    """What a RunStore asks before each write (the driver's RunLease)."""

    def check(self) -> None: ...


class RunStore:
    """Reads and writes one run's state document (the head) and its sealed index chunks."""

    def __init__(self, storage: Storage, name: str):
        self.storage, self.name = storage, name
        self.path = f"{name}/{STATE_FILE}"
        self.lease: Fence | None = None  # the driver's RunLease: every write asks it first

    def fence(self) -> None:
        """Raise RunLockedError if this driver no longer holds the run's lease."""
        if self.lease is not None:
            self.lease.check()

    def load(self) -> RunState | None:
        """The head, or None for a new run: one read, whatever the run's history."""
        raw = self.storage.read_bytes(self.path)
        return None if raw is None else self.parse(raw)

    def parse(self, raw: bytes) -> RunState:
        """The head from its stored bytes, checked as `load` checks it (StorageError if not)."""
        doc = self._json(raw, self.path, "run state")
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
        self.fence()
        state.schema_version = SCHEMA_VERSION
        state.updated_at = now()
        self.write(self.path, state.model_dump_json(indent=1).encode())

    def write(self, path: str, data: bytes) -> None:
        """A driver's write of the run's documents (run state, index chunk, manifest). Storage
        that cannot be reached past its client's retries (botocore's, `knobs.S3_RETRY_ATTEMPTS`)
        is waited for while this driver holds the lease: the write must happen before training
        goes on, and restarting ranks that are fine would not make it happen sooner. The lease
        bounds the wait (`fence` raises RunLockedError once it could not be renewed for its
        ttl): past that another driver may take the run over, and this one stops."""
        delay = 0.5
        while True:
            try:
                self.storage.write_atomic(path, data)
                return
            except Exception as e:
                if self.lease is None or not unreachable(e):
                    raise
                self.fence()
                logger.warning(
                    f"ft-train: storage unreachable writing {self.storage.uri(path)} "
                    f"({type(e).__name__}: {e}); trying again in {delay:g}s, while the lease holds"
                )
                time.sleep(delay)
                delay = min(2 * delay, knobs.STORAGE_WAIT_MAX_DELAY_S)

    def chunk_path(self, index: int) -> str:
        return f"{self.name}/{INDEX_DIR}/{index:06d}.json"

    def write_chunk(self, index: int, entries: list[CheckpointEntry]) -> None:
        """Write sealed chunk `index`. The caller saves the head that counts it only afterwards;
        a chunk left unreferenced by a crash is overwritten, with the same entries, by the next
        seal."""
        self.fence()
        chunk = IndexChunk(checkpoints=entries)
        self.write(self.chunk_path(index), chunk.model_dump_json(indent=1).encode())

    def all_checkpoints(self, state: RunState) -> list[CheckpointEntry]:
        """Every retained checkpoint, commit order: the sealed chunks', then the head's.
        Reads one object per sealed chunk; a rerun never needs this."""
        entries: list[CheckpointEntry] = []
        for index in range(state.sealed_chunks):
            path = self.chunk_path(index)
            doc = self._read_json(path, "checkpoint index chunk")
            if doc is None:
                raise StorageError(
                    f"{self.storage.uri(path)} is missing, but {self.storage.uri(self.path)} "
                    f"counts {state.sealed_chunks} sealed chunks; the run directory is damaged: "
                    "restore the file, or start a new run with another run_config.name"
                )
            try:
                entries += IndexChunk.model_validate(doc).checkpoints
            except ValidationError as e:
                raise StorageError(
                    f"{self.storage.uri(path)} is not a checkpoint index chunk: {e}"
                ) from None
        return entries + state.checkpoints

    def _read_json(self, path: str, what: str) -> dict[str, Any] | None:
        """The JSON object at `path`, or None when it does not exist."""
        raw = self.storage.read_bytes(path)
        return None if raw is None else self._json(raw, path, what)

    def _json(self, raw: bytes, path: str, what: str) -> dict[str, Any]:
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise StorageError(
                f"{self.storage.uri(path)} is not valid JSON ({e}); the run directory is "
                "damaged: restore the file, or start a new run with another run_config.name"
            ) from None
        if not isinstance(doc, dict):
            raise StorageError(f"{self.storage.uri(path)} is not a {what} (not an object)")
        return doc
