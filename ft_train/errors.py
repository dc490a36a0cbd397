"""The exception tree of ft-train.

    FtTrainError
    ├── ConfigError                  bad input; fails before any worker starts, never retried
    │   └── TrainLoopImportError     `train_loop` cannot be imported or called
    ├── StorageError                 the run directory is unusable (corrupt state, unreadable),
    │   │                            or a rank's asynchronous checkpoint upload failed
    │   └── CheckpointDamagedError   a committed checkpoint's files do not match its manifest
    ├── SessionError                 worker-side API used outside a training function, or misused
    ├── WorkerStartupError           not enough workers arrived in time
    ├── RunLockedError               another driver is training the run (it holds the lease)
    ├── TrainingFailedError          the run has failed for good (a budget is spent): what the
    │   │                            flow (and `TorchTrainer.fit()`) raises, and `result.error`
    │   └── WorkerGroupError         ... `max_failures` is spent on worker failures (Ray's name and
    │                                meaning); `worker_failures`: rank -> RankError
    ├── RankError                    one rank's failure, rebuilt on the driver (the original
    │                                exception may not pickle): type name, message, traceback text
    └── AttemptFailed                internal, not exported: one group attempt failed and the run
                                     retries (Prefect's task retry fires on it); never reaches users

Every exception here pickles (Prefect and Dask move them between processes): each keeps its
constructor arguments in `args`, and carries plain data only.
"""

from __future__ import annotations

from collections.abc import Mapping


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


class AttemptFailed(FtTrainError):
    """One group attempt failed: a rank raised, died or lost its worker, and the failure budget
    allows a retry. Internal: the retry signal between the controller and Prefect's task retry
    (`tasks.train`), not exported from `ft_train`; a run whose budget is spent raises
    `WorkerGroupError` instead. `failure`: the FailureRecord, as JSON."""

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


class WorkerGroupError(TrainingFailedError):
    """The run failed for good because `max_failures` is spent on worker failures (a rank
    raised, its process died, its node left, or it hung): Ray Train's `WorkerGroupError`.
    The message names max_failures and lists every failure that spent it.

    `worker_failures`: the failures of the last attempt, by rank, each a `RankError` rebuilt
    from the recorded failure (Ray gives the original exceptions; a user's exception may not
    pickle, so ft-train rebuilds it from its type name, message and traceback text).
    `failures`: every failure since the budget was last reset, as JSON (as for its base)."""

    def __init__(
        self,
        error_message: str,
        worker_failures: Mapping[int, Exception] | None = None,
        failures: list[dict] | None = None,
    ):
        FtTrainError.__init__(self, error_message, worker_failures, failures)
        self.worker_failures: dict[int, Exception] = dict(worker_failures or {})
        self.failures = failures or []


class RankError(FtTrainError, RuntimeError):
    """One rank's failure as the driver recorded it: `error` is "TypeName: message" (the
    training function's exception) or what happened to the rank ("worker ...: process died");
    `traceback` is the rank's traceback text ("" where none was taken: a process death, a
    hang); `kind` is the FailureRecord's (exception, process_death, node_loss, hang)."""

    def __init__(
        self,
        error: str,
        traceback: str = "",
        rank: int | None = None,
        step: int | None = None,
        kind: str = "exception",
    ):
        super().__init__(error, traceback, rank, step, kind)
        self.error, self.traceback, self.rank, self.step, self.kind = (
            error,
            traceback,
            rank,
            step,
            kind,
        )

    @property
    def type_name(self) -> str:
        """The original exception's class name (e.g. "ValueError"); "" if the rank did not
        raise (its process died, its node left, it hung)."""
        head, sep, _ = self.error.partition(": ")
        return head if self.kind == "exception" and sep and head.isidentifier() else ""

    def __str__(self) -> str:
        return self.error

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.error!r}, rank={self.rank}, step={self.step})"

    # Rebuilt exceptions compare by what they carry, so that two rebuilds of one failure (the
    # flow's error and `TrainResult.error` read from storage) are equal.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.args == self.args  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash(self.args)


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
