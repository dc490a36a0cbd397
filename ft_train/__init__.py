"""ft-train: fault-tolerant distributed PyTorch training, as a Prefect flow on Dask.

This package is the library; it never imports Prefect. The flow lives in `flows.train`.
"""

import importlib
import sys

from . import collective
from .callbacks import UserCallback
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
from .report_config import CheckpointConsistencyMode, CheckpointUploadMode
from .result import TrainResult
from .storage.checkpoint import Checkpoint
from .storage.run_state import FailureRecord
from .worker.reported_checkpoints import ReportedCheckpoint, ReportedCheckpointStatus
from .worker.session import (
    TrainContext,
    enable_jit_checkpoint,
    get_all_reported_checkpoints,
    get_checkpoint,
    get_context,
    get_preemption_info,
    report,
)
from .worker.uploads import staging_dir

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ClusterConfig",
    "ConfigError",
    "FailureConfig",
    "FailureRecord",
    "FtTrainError",
    "PreemptionInfo",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "RunConfig",
    "RunLockedError",
    "ScalingConfig",
    "SessionError",
    "StorageError",
    "TrainContext",
    "TrainLoopImportError",
    "TrainResult",
    "TrainingFailedError",
    "UserCallback",
    "WorkerGroupError",
    "WorkerStartupError",
    "collective",
    "enable_jit_checkpoint",
    "get_all_reported_checkpoints",
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
    # Ray Train's names: Ray's alias of one of ours, or refused naming what to use instead.
    from . import ray_names

    return ray_names.module_attribute(sys.modules[__name__], name)
