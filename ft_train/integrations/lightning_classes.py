"""PyTorch Lightning on ft-train's ranks, for either Lightning package: the behaviour of the
integration's classes, and `build(package)`, which makes them for `lightning` (`lightning.pytorch`)
or for `pytorch_lightning`.

The two packages ship the same code under two names, and each Trainer accepts only its own
package's callbacks, strategies and plugins: a class has to derive from the package the user
trains with. So the behaviour lives here in plain mixins that import no Lightning, and
`build()` puts each in front of the package's base class once per package. The public modules
`ft_train.integrations.lightning`, `ft_train.integrations.pytorch_lightning` and Ray's
`ft_train.lightning` hand out the classes built here, so that Ray's names and ft-train's are the
very same objects.

What each piece does, and why:
- `FtTrainEnvironment` (a `ClusterEnvironment`): world size and ranks come from
  `ft_train.get_context()`; the processes are ft-train's (`creates_processes_externally`), so
  Lightning launches none; the main address and port are the attempt's rendezvous (torchrun's
  MASTER_ADDR/MASTER_PORT, which ft-train sets in every rank). Lightning's setters are ignored:
  it would otherwise write its own idea of the world size (devices x nodes of one rank) into it.
- `DDPStrategy`, `FSDPStrategy`: Lightning's, on ft-train's process group, which is already
  initialised when the training function runs (gloo on CPU, NCCL on GPU: Lightning sees it and
  does not create another). The device is the rank's own (`ft_train.torch.get_device()`), and
  the sampler is sharded over ft-train's world, not over the devices one rank sees.
- `ReportCallback`: at each training epoch's end (Ray's), and every `every_n_train_steps`
  optimizer steps if asked, every rank calls `trainer.save_checkpoint` into a directory of its
  own (a collective: under FSDP every rank gathers or writes its shard) and then
  `ft_train.report(metrics, checkpoint=...)`, attaching the files it wrote (rank 0 the
  `checkpoint.ckpt`; the others nothing under DDP, their shards under sharded FSDP).
- `prepare_trainer`: refuses a Trainer that would not train on ft-train's ranks (another strategy
  would shard the data by the devices one rank sees; another environment, the world size), with
  a message naming what to pass instead.
- `resume_from()`: the latest committed checkpoint's `checkpoint.ckpt` for `trainer.fit(...,
  ckpt_path=...)`, or None on a fresh start.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import ft_train
from ft_train.errors import ConfigError

# The file a report's checkpoint holds (Ray's RayTrainReportCallback.CHECKPOINT_NAME).
CHECKPOINT_NAME = "checkpoint.ckpt"

# package name -> (the module Lightning's classes come from, the ft-train module that serves it)
PACKAGES = {
    "lightning": ("lightning.pytorch", "ft_train.integrations.lightning"),
    "pytorch_lightning": ("pytorch_lightning", "ft_train.integrations.pytorch_lightning"),
}

# Lightning arguments that ft-train owns: the process group exists before the Trainer does.
_OWNED = {
    "process_group_backend": (
        "the backend is ft-train's: gloo on CPU, NCCL with `ft_train.ScalingConfig(use_gpu=True)`"
    ),
    "timeout": (
        "a hung collective is ft-train's to detect: set `ft_train.FailureConfig(hang_timeout_s=...)`"
    ),
}


class EnvironmentMixin:
    """A `ClusterEnvironment` whose ranks are ft-train's (see the module docstring)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True  # ft-train started every rank: Lightning must not launch any

    @property
    def main_address(self) -> str:
        return _rendezvous("MASTER_ADDR")

    @property
    def main_port(self) -> int:
        return int(_rendezvous("MASTER_PORT"))

    @staticmethod
    def detect() -> bool:
        """True inside an ft-train rank (a training function that ft-train runs)."""
        try:
            ft_train.get_context()
        except ft_train.SessionError:
            return False
        return True

    def world_size(self) -> int:
        return ft_train.get_context().get_world_size()

    def set_world_size(self, size: int) -> None:
        pass  # ft-train's world: Lightning would set devices x nodes of one rank here

    def global_rank(self) -> int:
        return ft_train.get_context().get_world_rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # ft-train's rank, as above

    def local_rank(self) -> int:
        return ft_train.get_context().get_local_rank()

    def node_rank(self) -> int:
        return ft_train.get_context().get_node_rank()

    def teardown(self) -> None:
        pass  # the variables and the group are ft-train's, and outlive the Trainer


def _rendezvous(variable: str) -> str:
    value = os.environ.get(variable)
    if not value:
        raise ft_train.SessionError(
            f"{variable} is not set: FtTrainEnvironment serves a training function that ft-train "
            "runs (ft_train.torch.TorchTrainer, `ft-train run`, the flow), where it is"
        )
    return value


class StrategyMixin:
    """Lightning's strategy on ft-train's process group, device and world."""

    # Lightning's strategy, which the class built from this mixin derives from, has these
    world_size: int
    global_rank: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, instead in _OWNED.items():
            if kwargs.get(name) is not None:
                raise ConfigError(f"{type(self).__name__}({name}=...): {instead}")
        super().__init__(*args, **kwargs)

    @property
    def root_device(self) -> Any:
        import ft_train.torch

        return ft_train.torch.get_device()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Lightning's own is over num_nodes x num_processes, the devices one rank sees: 1 here
        return {"num_replicas": self.world_size, "rank": self.global_rank}


class ReportCallbackMixin:
    """Reports each checkpoint Lightning saves to ft-train, from every rank (module docstring).

    `every_n_train_steps`: also report every that many optimizer steps (`trainer.global_step`),
    besides each training epoch's end; None (the default, Ray's): at epoch ends only. A step
    already reported is not reported again at the epoch's end. The metrics are
    `trainer.callback_metrics` (tensors as numbers) with "epoch" and "step" (the global step)."""

    CHECKPOINT_NAME = CHECKPOINT_NAME

    def __init__(self, every_n_train_steps: int | None = None) -> None:
        if every_n_train_steps is not None and (
            isinstance(every_n_train_steps, bool)
            or not isinstance(every_n_train_steps, int)
            or every_n_train_steps < 1
        ):
            raise ConfigError(
                f"ReportCallback(every_n_train_steps={every_n_train_steps!r}): give a whole "
                "number of optimizer steps >= 1, or None to report at each epoch's end only"
            )
        super().__init__()
        self.every_n_train_steps = every_n_train_steps
        self.reported_step: int | None = None  # the global step of this callback's last report

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        n, step = self.every_n_train_steps, trainer.global_step
        # the same on every rank (DDP steps together), so every rank reports in the same rounds
        if n is not None and step % n == 0 and step != self.reported_step:
            self.report(trainer)

    def on_train_epoch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step != self.reported_step:
            self.report(trainer)

    def report(self, trainer: Any) -> None:
        """Save Lightning's checkpoint on every rank and report it with the metrics."""
        metrics = {k: _number(v) for k, v in trainer.callback_metrics.items()}
        metrics["epoch"] = trainer.current_epoch
        metrics["step"] = trainer.global_step
        directory = tempfile.mkdtemp(prefix="ft-train-lightning-")
        try:
            # every rank: the call is collective (a barrier; FSDP gathers or writes shards)
            trainer.save_checkpoint(os.path.join(directory, CHECKPOINT_NAME), weights_only=False)
            wrote = bool(os.listdir(directory))  # under DDP only rank 0 writes
            attached = ft_train.Checkpoint.from_directory(directory) if wrote else None
            ft_train.report(metrics, checkpoint=attached)  # uploaded before it returns
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.reported_step = trainer.global_step


def _number(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


@contextlib.contextmanager
def resume_from(checkpoint: ft_train.Checkpoint | None = None) -> Iterator[str | None]:
    """The path of `checkpoint`'s (by default the latest committed checkpoint's) Lightning file,
    for `trainer.fit(model, ckpt_path=...)`, valid inside the `with`; None when there is none
    (a fresh start, where `ckpt_path=None` trains from scratch)::

        with resume_from() as ckpt_path:
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    """
    checkpoint = checkpoint if checkpoint is not None else ft_train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:
        path = os.path.join(directory, CHECKPOINT_NAME)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"checkpoint {checkpoint.path} has no {CHECKPOINT_NAME} (it holds "
                f"{sorted(os.listdir(directory))}): it was not reported by the Lightning "
                "ReportCallback; load it yourself, or pass ckpt_path=None to start afresh"
            )
        yield path


def import_package(package: str) -> Any:
    """Lightning's trainer module of `package` ("lightning" or "pytorch_lightning")."""
    module = PACKAGES[package][0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"{PACKAGES[package][1]} needs {package}, which is not installed: "
            f'pip install "ft-train[lightning]" (or pip install {package.replace("_", "-")})'
        ) from e


@functools.cache
def build(package: str) -> SimpleNamespace:
    """The integration's classes for `package`, each deriving from that package's base class,
    named as in `PACKAGES[package][1]` (made once per package: the same objects every call)."""
    pl = import_package(package)
    module = PACKAGES[package][1]

    def make(name: str, mixin: type, base: type) -> type:
        doc = f"{mixin.__doc__}\n\nFor `{package}`: a `{base.__module__}.{base.__name__}`."
        return type(
            name, (mixin, base), {"__module__": module, "__qualname__": name, "__doc__": doc}
        )

    environments = importlib.import_module(f"{PACKAGES[package][0]}.plugins.environments")
    env = make("FtTrainEnvironment", EnvironmentMixin, environments.ClusterEnvironment)
    ddp = make("DDPStrategy", StrategyMixin, pl.strategies.DDPStrategy)
    fsdp = make("FSDPStrategy", StrategyMixin, pl.strategies.FSDPStrategy)
    callback = make("ReportCallback", ReportCallbackMixin, pl.callbacks.Callback)
    ns = SimpleNamespace(
        package=package,
        pl=pl,
        FtTrainEnvironment=env,
        DDPStrategy=ddp,
        FSDPStrategy=fsdp,
        ReportCallback=callback,
    )
    ns.prepare_trainer = _trainer_check(ns, module)
    return ns


def _trainer_check(ns: SimpleNamespace, module: str) -> Any:
    def prepare_trainer(trainer: Any) -> Any:
        """Check that `trainer` trains on ft-train's ranks, and return it (Ray's
        `prepare_trainer`). Raises ConfigError naming what to pass instead: a Trainer of the
        other Lightning package, a strategy other than this module's `DDPStrategy` or
        `FSDPStrategy` (or a subclass), `FSDPStrategy` on CPU (torch's FSDP needs GPUs), a
        cluster environment other than `FtTrainEnvironment`."""
        if not isinstance(trainer, ns.pl.Trainer):
            other = next(p for p in PACKAGES if p != ns.package)
            raise ConfigError(
                f"{module}.prepare_trainer got a {type(trainer).__module__}."
                f"{type(trainer).__name__}, not a {ns.package} Trainer: with {other}, import "
                f"the callback, strategy and environment from {PACKAGES[other][1]}"
            )
        strategy = trainer.strategy
        if not isinstance(strategy, (ns.DDPStrategy, ns.FSDPStrategy)):
            raise ConfigError(
                f"Trainer(strategy=...) is a {type(strategy).__name__}: pass "
                f"strategy={module}.DDPStrategy() (Ray: RayDDPStrategy), or FSDPStrategy() on GPU, "
                "so that Lightning trains on ft-train's process group, device and data shards"
            )
        if isinstance(strategy, ns.FSDPStrategy) and isinstance(
            trainer.accelerator, ns.pl.accelerators.CPUAccelerator
        ):
            # torch's FSDP (FullyShardedDataParallel) refuses CPU on the ranks ("FSDP needs a
            # non-CPU accelerator device"): refused here, once, not retried as a rank's failure
            raise ConfigError(
                f"Trainer(strategy={module}.FSDPStrategy()) on CPU: torch's FSDP needs GPUs; "
                "give ScalingConfig(use_gpu=True) and Trainer(accelerator='gpu'), or "
                f"strategy={module}.DDPStrategy() on CPU"
            )
        environment = getattr(strategy, "cluster_environment", None)
        if not isinstance(environment, ns.FtTrainEnvironment):
            raise ConfigError(
                f"the Trainer's cluster environment is a {type(environment).__name__}: pass "
                f"Trainer(plugins=[{module}.FtTrainEnvironment()]) (Ray: RayLightningEnvironment), "
                "so that Lightning sees ft-train's world size and ranks"
            )
        return trainer

    prepare_trainer.__module__ = module
    return prepare_trainer
