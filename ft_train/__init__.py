"""ft-train: fault-tolerant distributed PyTorch training, as a Prefect flow on Dask.

This package is the library; it never imports Prefect. The flow lives in `flows.train`.
"""

import importlib

from . import collective
from .config import CheckpointConfig, ClusterConfig, FailureConfig, RunConfig, ScalingConfig
from .errors import (
    ConfigError,
    FtTrainError,
    RunLockedError,
    SessionError,
    StorageError,
    TrainingFailedError,
    TrainLoopImportError,
    WorkerGroupError,
    WorkerStartupError,
)
from .protocol import PreemptionInfo
from .result import TrainResult
from .storage.checkpoint import Checkpoint
from .storage.run_state import FailureRecord
from .worker.session import (
    TrainContext,
    enable_jit_checkpoint,
    get_checkpoint,
    get_context,
    get_preemption_info,
    report,
)
from .worker.uploads import staging_dir

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "FailureConfig",
    "FailureRecord",
    "FtTrainError",
    "PreemptionInfo",
    "RunConfig",
    "RunLockedError",
    "ScalingConfig",
    "SessionError",
    "StorageError",
    "TrainContext",
    "TrainLoopImportError",
    "TrainResult",
    "TrainingFailedError",
    "WorkerGroupError",
    "WorkerStartupError",
    "collective",
    "enable_jit_checkpoint",
    "get_checkpoint",
    "get_context",
    "get_preemption_info",
    "report",
    "staging_dir",
]


def __getattr__(name: str):
    # `ft_train.torch` imports torch: load it when first used, not with the package.
    if name == "torch":
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'ft_train' has no attribute {name!r}")
