"""Ray Train's trainer, `ft_train.torch.TorchTrainer`: a run started from Python as Ray starts one.

    result = TorchTrainer(train_fn, train_loop_config={...},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=..., name=...)).fit()

`fit()` is a Python call of the Prefect flow `ft-train` (`flows.train:train`) with these
parameters: it returns the run's `TrainResult`, and raises the error the run failed with, as Ray's
`fit()` raises `result.error` (a `TrainingFailedError` once the failure budget is spent). Without
`run_config.name` each `fit()` is a new run with a generated name (`ft_train.run_name`), shown in
`result.path`; with the name of a run that exists, `fit()` resumes it, as in Ray.

The library never imports Prefect, nor the module of the flow: `fit()` finds the flow through the
one entry point registered for it (group `ft_train`, name `flow`, in pyproject.toml), read with
`importlib.metadata`, the only way from the library to an adapter (tests/test_layout.py checks).

Ray's other constructor arguments are refused by name (`REFUSED`, a ConfigError naming what to
use instead) when the trainer is built, before anything starts; so are Ray's deprecated
`restore()` and `can_restore()`. `None`, Ray's default for each of them, asks for nothing and is
accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel

from .cluster_config import ClusterConfig
from .config import RunConfig, ScalingConfig, parse
from .errors import ConfigError
from .result import TrainResult

__all__ = ["REFUSED", "TorchTrainer", "find_flow"]

FLOW_GROUP, FLOW_NAME = "ft_train", "flow"

_NO_DATA = (
    "Ray Data is not part of ft-train: build a torch DataLoader inside train_loop_per_worker "
    "and shard it with ft_train.torch.prepare_data_loader"
)
_NO_BACKEND = (
    "ft-train sets up torch.distributed itself (gloo on CPU, NCCL with "
    "ScalingConfig(use_gpu=True); its collectives time out a little before "
    "FailureConfig.hang_timeout_s): leave it out"
)
_RESTORE = (
    "the same RunConfig(storage_path, name) resumes a run: build the trainer again with them "
    "and call fit(); it resumes from the run's latest committed checkpoint"
)

# Ray's TorchTrainer / DataParallelTrainer arguments that ft-train does not take, with what to
# use instead.
REFUSED: dict[str, str] = {
    "torch_config": _NO_BACKEND,
    "backend_config": _NO_BACKEND,
    "datasets": _NO_DATA,
    "dataset_config": _NO_DATA,
    "validation_config": "ft-train has no asynchronous validation tasks: validate in "
    "train_loop_per_worker and report the validation metrics with ft_train.report()",
    "metadata": "deprecated in Ray (it raises there too): pass the values through "
    "train_loop_config",
    "resume_from_checkpoint": "pass the checkpoint's path through train_loop_config and load "
    "it in train_loop_per_worker when ft_train.get_checkpoint() is None, as Ray's migration "
    "guide says (a run resumes its own checkpoints when fit() is called again with the same "
    "RunConfig(storage_path, name))",
}


class TorchTrainer:
    """Data-parallel PyTorch training of `train_loop_per_worker` on every rank, as Ray's
    `ray.train.torch.TorchTrainer`; `fit()` runs it (the `ft-train` flow) and returns the
    `TrainResult`.

    Args:
        train_loop_per_worker: the training function, called as `fn(train_loop_config)` on
            every rank (or `fn()` where it takes no parameter); an import path
            'package.module:function' also works.
        train_loop_config: a dict of JSON values passed to it.
        scaling_config: `ft_train.ScalingConfig` (default: 1 rank on CPU).
        run_config: `ft_train.RunConfig` (default: a new run with a generated name under
            ~/ft_train_results).
        cluster: `ft_train.ClusterConfig`, ft-train's own (default: a local Dask cluster).
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any] | str,
        *,
        train_loop_config: dict[str, Any] | None = None,
        scaling_config: ScalingConfig | dict | None = None,
        run_config: RunConfig | dict | None = None,
        cluster: ClusterConfig | dict | None = None,
        **ray_arguments: Any,
    ):
        for name, value in ray_arguments.items():
            if name not in REFUSED:
                raise TypeError(
                    f"TorchTrainer() got an unexpected keyword argument {name!r}; its arguments "
                    "are train_loop_per_worker, train_loop_config, scaling_config, run_config "
                    "and cluster"
                )
            if value is not None:
                raise ConfigError(f"TorchTrainer({name}=...) is not supported: {REFUSED[name]}")
        # What the flow checks too, here: bad input fails where the trainer is built, as in Ray.
        from .driver.prepare import loop_config
        from .worker.rank import load_train_loop

        load_train_loop(train_loop_per_worker)
        loop_config(train_loop_config)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = _config(ScalingConfig, scaling_config, "scaling_config")
        self.run_config = _config(RunConfig, run_config, "run_config")
        self.cluster = _config(ClusterConfig, cluster, "cluster")

    def fit(self) -> TrainResult:
        """Train (or resume) the run and return its result; raise the error it failed with
        (`TrainingFailedError` when the failure budget is spent, as Ray's fit() raises
        `result.error`). A flow run of the `ft-train` flow, in Prefect's ephemeral mode unless
        PREFECT_API_URL names a server."""
        train = find_flow()
        return train(
            train_loop=self.train_loop_per_worker,
            train_loop_config=self.train_loop_config,
            scaling_config=self.scaling_config,
            run_config=self.run_config,
            cluster=self.cluster,
        )

    @classmethod
    def restore(cls, *args: Any, **kwargs: Any) -> TorchTrainer:
        """Ray's deprecated `Trainer.restore` (it raises in Ray Train V2): refused."""
        raise ConfigError(
            f"TorchTrainer.restore() is not supported (deprecated in Ray): {_RESTORE}"
        )

    @classmethod
    def can_restore(cls, *args: Any, **kwargs: Any) -> bool:
        """Ray's deprecated `Trainer.can_restore` (it raises in Ray Train V2): refused."""
        raise ConfigError(
            "TorchTrainer.can_restore() is not supported (deprecated in Ray): "
            f"{_RESTORE}; ft_train.TrainResult.from_path(storage_path, name) reads a stored run"
        )


def _config(model: type[BaseModel], value: Any, parameter: str) -> Any:
    """`value` as a `model`: a `model` as it is, a dict validated into one, None the default.
    Anything else (Ray's own config classes) is refused naming ft-train's."""
    if value is None:
        return model()
    if not isinstance(value, (model, dict)):
        raise ConfigError(
            f"TorchTrainer({parameter}=...) must be an ft_train.{model.__name__} (or a dict of "
            f"its fields), not a {type(value).__module__}.{type(value).__qualname__}"
        )
    return parse(model, value, parameter)


def find_flow(group: str = FLOW_GROUP, name: str = FLOW_NAME) -> Callable[..., TrainResult]:
    """The `ft-train` flow, through its registered entry point (the library imports no
    adapter). ConfigError where ft-train is installed without it, or it does not load."""
    found = [e for e in entry_points(group=group) if e.name == name]
    if not found:
        raise ConfigError(
            f"TorchTrainer.fit() runs ft-train's Prefect flow, found through the entry point "
            f"{name!r} in group {group!r}, and none is registered in this Python environment: "
            "install ft-train with it (`pip install -e .` in a checkout of ft-train, or "
            "`pip install ft-train`), then run again"
        )
    try:
        return found[0].load()
    except ImportError as e:
        raise ConfigError(
            f"TorchTrainer.fit(): the entry point {name!r} in group {group!r} names "
            f"{found[0].value!r}, which does not import ({type(e).__name__}: {e}); reinstall "
            "ft-train (`pip install -e .` in a checkout) where its flow and Prefect import"
        ) from e
