"""The exception tree of ft-train.

    FtTrainError
    ├── ConfigError                  bad input; fails before any worker starts, never retried
    │   └── TrainLoopImportError     `train_loop` cannot be imported or called
    ├── StorageError                 the run directory is unusable (corrupt state, unreadable),
    │   │                            or a rank's asynchronous checkpoint upload failed
    │   └── CheckpointDamagedError   a committed checkpoint's files do not match its manifest
    ├── SessionError                 worker-side API used outside a training function, or misused
    ├── WorkerGroupError             a rank raised, died, or its worker was lost: retryable
    │   └── (carries `failure`, a FailureRecord)
    ├── WorkerStartupError           not enough workers arrived in time
    ├── RunLockedError               another driver is training the run (it holds the lease)
    └── TrainingFailedError          the failure budget is spent: the run has failed

Every exception here pickles (Prefect and Dask move them between processes): each keeps its
constructor arguments in `args`, and carries plain data only.
"""

from __future__ import annotations


class FtTrainError(Exception):
    """Root of every error ft-train raises on purpose."""


class ConfigError(FtTrainError, ValueError):
    """Invalid input. The message names the setting and the fix. Never retried."""


class TrainLoopImportError(ConfigError):
    """`train_loop` could not be imported; a retry cannot fix it."""


class StorageError(FtTrainError):
    """The run directory cannot be read or is inconsistent."""


class CheckpointDamagedError(StorageError):
    """A committed checkpoint's stored files do not match its manifest (a file is missing, or its
    size or checksum differs). `path` is the checkpoint's."""

    def __init__(self, message: str, path: str):
        super().__init__(message, path)
        self.path = path

    def __str__(self) -> str:
        return self.args[0]


class SessionError(FtTrainError, RuntimeError):
    """The worker-side API was called outside a training function, or against its contract."""


class WorkerGroupError(FtTrainError):
    """One group attempt failed: a rank raised, died or lost its worker. The run may retry."""

    def __init__(self, message: str, failure: dict | None = None):
        super().__init__(message, failure)
        self.failure = failure or {}

    def __str__(self) -> str:
        return self.args[0]

    def __repr__(self) -> str:  # Prefect logs repr(): the message says it all
        return f"{type(self).__name__}({self.args[0]!r})"


class WorkerStartupError(FtTrainError):
    """Not enough Dask workers became available within the startup timeout."""


class TrainingFailedError(FtTrainError):
    """The run failed for good: the failure budget (`max_failures`) is spent."""

    def __init__(self, message: str, failures: list[dict] | None = None):
        super().__init__(message, failures)
        self.failures = failures or []

    def __str__(self) -> str:
        return self.args[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.args[0]!r})"


class RankFailure(Exception):
    """Raised by a rank's Dask task: the user function raised. Plain data, so it pickles
    whatever the user's exception was."""

    def __init__(
        self,
        rank: int,
        step: int,
        error: str,
        traceback: str,
        fatal: bool = False,
        damaged: str | None = None,
    ):
        super().__init__(rank, step, error, traceback, fatal, damaged)
        self.rank, self.step, self.error, self.traceback = rank, step, error, traceback
        self.fatal = fatal  # a broken contract (ConfigError, SessionError): never retried
        self.damaged = damaged  # the path of a checkpoint found damaged (CheckpointDamagedError)

    def __str__(self) -> str:
        return f"rank {self.rank} raised at step {self.step}: {self.error}"


class RunLockedError(FtTrainError):
    """Another driver holds the run's lease (it is training the run now), or this driver lost
    it. Never retried: the other driver owns the run."""
