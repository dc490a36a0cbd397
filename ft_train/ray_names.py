"""Ray Train's names as a ported script meets them: those ft-train does not offer, each refused
with what to use instead, and those that are only another name for an ft-train object.

A script written for Ray Train V2 runs after renaming `ray.train` to `ft_train` (DESIGN.md, "Ray
Train compatibility"): every Ray name it touches either works with Ray's meaning, or is refused
here with a `ConfigError` whose message names what to use instead, never accepted with another
meaning. Refusals come before any worker starts: at import or attribute access
(`from ft_train import DataConfig`), or when a config is built (`ScalingConfig(use_tpu=True)`).
A `ConfigError`, not an `AttributeError`, for a module's names: `from m import x` replaces an
AttributeError raised by the module with its own "cannot import name", which would drop the
alternative. An instance's refused attribute raises `RayNameRefused`, a ConfigError that is also
an AttributeError, so that `hasattr()` and `getattr(obj, name, default)` (as libraries probe
objects) still answer "no".

The list of Ray's names is checked in (`tests/data/ray_train_names.json`, made from the Ray wheel);
`tests/unit/test_ray_names.py` holds each name on it to working in ft-train, or to a refusal here
(or in the piece that owns it: `TorchTrainer`'s arguments, `report()`'s), and
`docs/migrating-from-ray.md` gives the same table for people.

Each text below says what to use instead; an ft-train name in it is written in backticks as
`ft_train....` so that the test can check that it exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ConfigError

__all__ = [
    "ALIASES",
    "REFUSED",
    "RayNameRefused",
    "RefusesRayNames",
    "module_attribute",
    "refusal",
    "refused_field",
]

_RAY_DATA = (
    "ft-train has no Ray Data: build a torch DataLoader in the training function and give it to "
    "`ft_train.torch.prepare_data_loader` (each rank its shard)"
)
_RAY_TUNE = "Ray deprecated it too (a Ray Tune setting)"

# Where ft-train's object sits (a module, or a class by its name) -> Ray's name there -> what to
# use instead.
REFUSED: dict[str, dict[str, str]] = {
    "ft_train": {
        "get_dataset_shard": _RAY_DATA,
        "DataConfig": _RAY_DATA,
        "TRAIN_DATASET_KEY": _RAY_DATA,
        "BackendConfig": (
            "the backend is torch.distributed, gloo on CPU and NCCL with "
            "`ft_train.ScalingConfig.use_gpu`; collectives time out by "
            "`ft_train.FailureConfig.hang_timeout_s`"
        ),
        "SyncConfig": (
            "checkpoints are written straight to `ft_train.RunConfig.storage_path` (any fsspec "
            "URL, with `ft_train.RunConfig.storage_options`): there is nothing to sync"
        ),
        "ControllerError": (
            "ft-train raises `ft_train.WorkerStartupError` when too few workers arrive within "
            "`ft_train.ScalingConfig.worker_start_timeout_s`; a crash of the driver (a Prefect "
            "flow run) never fails the run: the next flow run with the same "
            "`ft_train.RunConfig.name` resumes it"
        ),
        "NCCLHangError": (
            "a rank that makes no report() for `ft_train.FailureConfig.hang_timeout_s` is a "
            "worker failure like any other: the run ends with `ft_train.WorkerGroupError` once "
            "max_failures is spent"
        ),
        "PreemptionError": (
            "a run that spends `ft_train.FailureConfig.max_preemption_failures` ends with "
            "`ft_train.TrainingFailedError`, each failure of kind 'preemption' in its failures"
        ),
        "LoggingConfig": (
            "ft-train logs through Python's logging: set the level of the 'ft_train' logger"
        ),
        "ValidationConfig": (
            "ft-train has no checkpoint validation: validate in the training function and "
            "report the score with `ft_train.report` as a metric"
        ),
        "ValidationFn": (
            "ft-train has no checkpoint validation: validate in the training function and "
            "report the score with `ft_train.report` as a metric"
        ),
        "ValidationTaskConfig": (
            "ft-train has no checkpoint validation: validate in the training function and "
            "report the score with `ft_train.report` as a metric"
        ),
    },
    "ft_train.torch": {
        "TorchCheckpoint": (
            "save with torch.save into a directory and report "
            "`ft_train.Checkpoint.from_directory` of it"
        ),
        "TorchConfig": (
            "the backend follows `ft_train.ScalingConfig.use_gpu` (gloo or NCCL); collectives "
            "time out by `ft_train.FailureConfig.hang_timeout_s`"
        ),
        "accelerate": (
            "Ray deprecated it: use torch.autocast and torch.amp.GradScaler in the training "
            "function"
        ),
        "prepare_optimizer": (
            "Ray deprecated it: use torch.autocast and torch.amp.GradScaler in the training "
            "function"
        ),
        "backward": (
            "Ray deprecated it: use torch.autocast and torch.amp.GradScaler in the training "
            "function, and loss.backward()"
        ),
    },
    "RunConfig": {
        "storage_filesystem": (
            "give `ft_train.RunConfig.storage_path` as an fsspec URL (s3://bucket/prefix) and "
            "the filesystem's options in `ft_train.RunConfig.storage_options`"
        ),
        "worker_runtime_env": (
            "the ranks' environment is their Dask workers': install and set it on the cluster "
            "(`ft_train.ClusterConfig.cluster_kwargs`, e.g. env=, or `dask worker`'s), and "
            "preload heavy imports with `ft_train.ClusterConfig.preload`"
        ),
        "logging_config": (
            "ft-train logs through Python's logging: set the level of the 'ft_train' logger"
        ),
        "sync_config": f"{_RAY_TUNE}; checkpoints go straight to `ft_train.RunConfig.storage_path`",
        "verbose": f"{_RAY_TUNE}; set the level of the 'ft_train' logger",
        "stop": f"{_RAY_TUNE}; return from the training function to stop",
        "progress_reporter": f"{_RAY_TUNE}; progress shows in the Prefect UI and "
        "`ft_train.TrainResult.metrics_history`",
        "log_to_file": f"{_RAY_TUNE}; the flow run's logs are in Prefect",
    },
    "ScalingConfig": {
        "trainer_resources": (
            "Ray deprecated it: the driver runs in the Prefect flow's process, not on a worker"
        ),
        "resources_per_worker": (
            "ranks run one per Dask worker: give the workers their resources where they start "
            "(`dask worker --resources GPU=1 --nthreads N`, or "
            "`ft_train.ClusterConfig.cluster_kwargs`), and a GPU each with "
            "`ft_train.ScalingConfig.use_gpu`"
        ),
        "placement_strategy": (
            "ranks run one per Dask worker, wherever the cluster put the workers: choose the "
            "cluster with `ft_train.ClusterConfig`"
        ),
        "accelerator_type": (
            "start GPU workers of the type you want (`ft_train.ClusterConfig.cluster_kwargs`, or "
            "`dask worker --resources GPU=1` on those machines) and set "
            "`ft_train.ScalingConfig.use_gpu`"
        ),
        "label_selector": (
            "ranks run on the Dask workers the cluster has: pick machines where the workers "
            "start (`ft_train.ClusterConfig`)"
        ),
        "use_tpu": "ft-train trains on CPUs or GPUs (`ft_train.ScalingConfig.use_gpu`)",
        "topology": "ft-train trains on CPUs or GPUs (`ft_train.ScalingConfig.use_gpu`)",
        "elastic_resize_monitor_interval_s": (
            "an elastic group (`ft_train.ScalingConfig.num_workers` as (min, max)) grows back to "
            "max at its next restart, waiting up to `ft_train.ScalingConfig.elastic_wait_s` "
            "for the workers"
        ),
    },
    "FailureConfig": {
        "fail_fast": "Ray deprecated it: give `ft_train.FailureConfig.max_failures`=0",
        "controller_failure_limit": (
            "ft-train has no controller failures to count: a (re)start that finds too few "
            "workers fails after `ft_train.ScalingConfig.worker_start_timeout_s`, a group that "
            "fails three times in a row before all its ranks joined ends the run, and rank and "
            "worker failures count against `ft_train.FailureConfig.max_failures`"
        ),
        "relax_collectives_on_preemption": (
            "ft-train's report() and get_preemption_info() need every rank: a just-in-time "
            "checkpoint is saved while the leaving workers are still there, within the notice "
            "(see `ft_train.get_preemption_info`)"
        ),
    },
    "CheckpointConfig": {
        "checkpoint_frequency": (
            "Ray deprecated it: attach a checkpoint to `ft_train.report` when you want one"
        ),
        "checkpoint_at_end": (
            "Ray deprecated it: attach a checkpoint to the last `ft_train.report` call"
        ),
    },
    "Checkpoint": {
        "filesystem": (
            "ft-train reaches storage through fsspec: `ft_train.Checkpoint.path` is a URL or "
            "local path, and `ft_train.Checkpoint.storage_options` are its fsspec options"
        ),
    },
    "TrainResult": {
        "config": (
            "Ray deprecated it (a Ray Tune notion): keep the config you passed as train_loop_config"
        ),
        # Also where a property raises AttributeError for it: Python then asks __getattr__.
        "filesystem": (
            "ft-train reaches storage through fsspec: `ft_train.TrainResult.path` is a URL or "
            "local path, and fsspec.core.url_to_fs(result.path, **storage_options) gives its "
            "filesystem"
        ),
    },
    "TrainContext": {
        **{
            name: f"Ray deprecated it (a Ray Tune notion); {instead}"
            for name, instead in {
                "get_metadata": "pass what you need in train_loop_config",
                "get_trial_name": "use `ft_train.TrainContext.get_experiment_name`",
                "get_trial_id": "use `ft_train.TrainContext.get_experiment_name`",
                "get_trial_resources": "use `ft_train.TrainContext.get_world_size`",
                "get_trial_dir": "write checkpoints through `ft_train.report`",
            }.items()
        },
        "get_storage": (
            "ft-train's storage is `ft_train.RunConfig.storage_path`: report checkpoints with "
            "`ft_train.report`, and read the run with `ft_train.TrainResult.from_path`"
        ),
    },
}

# Ray's names for the very same ft-train object (not a look-alike): where -> Ray's -> ft-train's.
ALIASES: dict[str, dict[str, str]] = {"ft_train": {"Result": "TrainResult"}}

# How the owner of a refused name is written in Ray, for the message.
_RAY_OWNER = {
    "ft_train": "ray.train",
    "ft_train.torch": "ray.train.torch",
    "TrainResult": "ray.train.Result",
}


def refusal(where: str, name: str) -> ConfigError | None:
    """The error refusing Ray's `name` in `where` (a module, or a class by its name), or None
    if ft-train does not refuse it there."""
    instead = REFUSED.get(where, {}).get(name)
    if instead is None:
        return None
    ray = _RAY_OWNER.get(where, f"ray.train.{where}")
    return ConfigError(
        f"{ray}.{name} is Ray Train's, and ft-train does not offer it: {instead} "
        "(docs/migrating-from-ray.md)"
    )


def module_attribute(module: Any, name: str) -> Any:
    """For a module's `__getattr__`: Ray's alias of one of its objects, or a refusal, or the
    AttributeError Python would raise."""
    alias = ALIASES.get(module.__name__, {}).get(name)
    if alias is not None:
        return getattr(module, alias)
    error = refusal(module.__name__, name)
    if error is not None:
        raise error
    raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")


def refused_field(model: str, data: Any) -> str | None:
    """The message refusing the first of Ray's fields that ft-train's config `model` does not
    offer, if `data` (a config's keyword arguments) holds one."""
    if not isinstance(data, dict):
        return None
    for name in data:
        error = refusal(model, name)
        if error is not None:
            return str(error)
    return None


class RayNameRefused(ConfigError, AttributeError):
    """An instance attribute of Ray's that ft-train does not offer (`RefusesRayNames`)."""


class RefusesRayNames:
    """A base that makes an instance's missing attribute a refusal where Ray's class has it
    (`REFUSED[<the class's name>]`); every other missing attribute stays an AttributeError."""

    __slots__ = ()

    # Hidden from type checkers: to them a class with __getattr__ has every attribute (a typo
    # would pass, and a result would look awaitable to Prefect's overloads).
    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            error = refusal(type(self).__name__, name)
            if error is not None:
                raise RayNameRefused(str(error))
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
