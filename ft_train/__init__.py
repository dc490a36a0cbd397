"""ft-train: fault-tolerant distributed PyTorch training, as a Prefect flow on Dask.

This package is the library; it never imports Prefect. The flow lives in `flows.train`.
"""

import importlib

from .checkpoint import Checkpoint
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
from .result import TrainResult
from .run_state import FailureRecord
from .protocol import PreemptionInfo
from .session import TrainContext, get_checkpoint, get_context, get_preemption_info, report
from .uploads import staging_dir

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
