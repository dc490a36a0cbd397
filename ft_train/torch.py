"""Torch helpers for the training function, with the meaning of Ray Train's `ray.train.torch`:
this rank's device (`get_device`, `get_devices`), the model made data-parallel
(`prepare_model`), the loader sharded over the ranks (`prepare_data_loader`),
`enable_reproducibility`; and ft-train's sharded checkpoints (`save_sharded`, `load_sharded`,
torch.distributed.checkpoint).

Ray's AMP helpers (`accelerate`, `backward`, `prepare_optimizer`) are not here: Ray Train V2
itself refuses them (they raise DeprecationWarning), pointing to torch's own mixed precision
(`torch.autocast`, `torch.amp.GradScaler`).

The data order. `prepare_data_loader` never moves the sampler's epoch by itself: the loop sets
it at the top of each epoch, from the epoch it restored, so that a restarted run sees the same
batches as an uninterrupted one (Ray's getting-started pattern)::

    loader = ft_train.torch.prepare_data_loader(DataLoader(dataset, batch_size=32, shuffle=True))
    for epoch in range(start_epoch, epochs):  # start_epoch: from the checkpoint
        if ft_train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)  # or loader.set_epoch(epoch): the same thing
        for x, y in loader:
            ...

At one rank the loader keeps its own sampler, as Ray's does: a `shuffle=True` loader's
`RandomSampler` draws from torch's global generator (or the loader's `generator`), which a new
process starts afresh. For an order that depends only on (seed, epoch) at every size, give the
loader a `DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)` of your
own: `prepare_data_loader` keeps it, and `set_epoch` works at one rank too.

Resuming inside an epoch, at the exact batch: use torchdata's `StatefulDataLoader` (it stays one:
`prepare_data_loader` returns a loader of the class it is given), save its position in the
checkpoint, every rank its own file, and load it on resume, before the epoch's first `iter`
(torchdata is not installed here; this example is not run by the tests)::

    from torchdata.stateful_dataloader import StatefulDataLoader

    rank = ft_train.get_context().get_world_rank()
    loader = ft_train.torch.prepare_data_loader(StatefulDataLoader(ds, batch_size=32, shuffle=True))
    epoch = 0
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, f"rank{rank}.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch = state["epoch"]
        loader.load_state_dict(state["loader"])  # the next iter() goes on after the saved batch
    while epoch < epochs:
        loader.sampler.set_epoch(epoch)  # before iter(): the order the saved position is in
        for x, y in loader:
            ...  # a step
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": ..., "optimizer": ..., "epoch": epoch,
                            "loader": loader.state_dict()}, os.path.join(d, f"rank{rank}.pt"))
                ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(d))
        epoch += 1

The position saved after an epoch's last batch says "at the end": the loop then starts the
next epoch (save `epoch + 1` and a fresh position there if you prefer).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from .errors import ConfigError
from .worker.session import get_context

logger = logging.getLogger("ft_train")

PARALLEL_STRATEGIES = ("ddp", "fsdp", "fsdp2", None)


def get_device() -> torch.device:
    """This rank's device: its GPU when the run uses GPUs (ScalingConfig.use_gpu), else `cpu`."""
    if torch.cuda.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_devices() -> list[torch.device]:
    """This rank's devices, as Ray's `get_devices`: ft-train gives each rank one GPU (or the
    CPU), so the list has one device, `get_device()`."""
    return [get_device()]


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move the model to this rank's device and make it data-parallel, as Ray's `prepare_model`.

    `move_to_device`: True moves it to `get_device()`, a `torch.device` moves it there, False
    leaves it where it is. `parallel_strategy` (`parallel_strategy_kwargs` go to the wrapper):
    - "ddp" (the default): DistributedDataParallel when there is more than one rank.
    - "fsdp": Ray's meaning, FSDP1's FullyShardedDataParallel when there is more than one rank,
      on GPUs only. Without a GPU it is refused (Ray refuses it too, at more than one rank):
      use "fsdp2".
    - "fsdp2" (ft-train's own): FSDP2's `fully_shard` at the root, also on one rank, so that
      its state dict is DTensors whatever the size (kwargs: reshard_after_forward, mp_policy,
      ...). Call `fully_shard` on the blocks you want as units first (each transformer block,
      as torchtitan does). Runs on CPU with gloo. Save it with `save_sharded` (every rank its
      shard).
    - None: no wrapping.
    """
    _check_arguments(move_to_device, parallel_strategy)
    kwargs = dict(parallel_strategy_kwargs or {})
    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if parallel_strategy == "fsdp" and device.type != "cuda":
        # Ray's "fsdp" is FSDP1, which refuses CPU ("FSDP needs a non-CPU accelerator device");
        # refused at one rank too, so that a one-rank test does not pass where the run fails.
        raise ConfigError(
            f"prepare_model(parallel_strategy='fsdp') is FSDP1 (FullyShardedDataParallel, as in "
            f"Ray), which needs GPUs (ScalingConfig(use_gpu=True)); this rank's device is "
            f"{device}. For FSDP2's fully_shard, which also runs on CPU, use "
            "parallel_strategy='fsdp2'"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if move_to_device is not False:
        model = model.to(device)
    if parallel_strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, **kwargs)  # in place: the model's class becomes an FSDPModule
        return model
    if parallel_strategy is None or get_context().get_world_size() == 1:
        return model
    if parallel_strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, **kwargs)
    if device.type == "cuda":
        kwargs = {"device_ids": [device], "output_device": device, **kwargs}
    return DistributedDataParallel(model, **kwargs)


def _check_arguments(move_to_device: Any, parallel_strategy: Any) -> None:
    """prepare_model's arguments as Ray's: refused naming the fix, before the model is touched."""
    if not isinstance(move_to_device, (bool, torch.device)):
        # e.g. prepare_model(model, "ddp"): the second argument is Ray's move_to_device, as here
        raise ConfigError(
            f"prepare_model(move_to_device={move_to_device!r}): give True, False or a "
            "torch.device; the second argument is move_to_device (Ray's order): pass the "
            "strategy by keyword, parallel_strategy='ddp'"
        )
    if parallel_strategy not in PARALLEL_STRATEGIES:
        raise ConfigError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}): give 'ddp', 'fsdp' "
            "(FSDP1, GPUs only), 'fsdp2' (FSDP2's fully_shard) or None (no wrapping)"
        )


def enable_reproducibility(seed: int = 0) -> None:
    """Limit nondeterminism, as Ray's `enable_reproducibility`: seed torch, Python's `random`
    and NumPy (when installed) with `seed`, use deterministic algorithms only, and turn cuDNN's
    benchmarking off. Deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG: set to ":4096:8", as
    Ray does, unless the process already has one. As Ray says, this cannot make every run
    reproducible (https://pytorch.org/docs/stable/notes/randomness.html)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # nothing of NumPy's to seed
        pass
    else:
        np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def save_sharded(state: dict[str, Any], directory: str) -> None:
    """Save `state` (e.g. `torch.distributed.checkpoint.state_dict.get_state_dict(model,
    optimizer)`, plus plain values) with torch.distributed.checkpoint, every rank its own
    shard, into `directory`, a directory of this rank's own: then attach it to `report()` on
    every rank. The files of all ranks form one checkpoint (`__{rank}_0.distcp` each, and rank
    0's `.metadata`). Every rank must call it (it is a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True))


def load_sharded(state: dict[str, Any], directory: str) -> None:
    """Load a `save_sharded` checkpoint into `state` in place (the same structure, e.g. a fresh
    model's `get_state_dict`; apply it with `set_state_dict`): `directory` is the restored
    checkpoint's (`get_checkpoint().as_directory()`), which holds every rank's files. Each rank
    reads the parts of its shard, also at another world size. A collective."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=directory)


def prepare_data_loader(
    data_loader: DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
    seed: int = 0,
) -> DataLoader:
    """Shard `data_loader` over the ranks, as Ray's `prepare_data_loader`, and return a loader
    of its own class (a subclass made for it: `isinstance` holds, and a StatefulDataLoader keeps
    `state_dict`/`load_state_dict`), with its other settings.

    `add_dist_sampler`: at more than one rank, a `DistributedSampler` takes the loader's
    sampler's place (seed `seed`; it shuffles unless the loader's sampler was a
    SequentialSampler, i.e. `shuffle=True`, as Ray decides), unless the loader has one already
    or its dataset is an IterableDataset (which shards itself). At one rank the loader keeps
    its own sampler, as Ray's does. The epoch is never moved here: call
    `loader.sampler.set_epoch(e)` (Ray's way) or `loader.set_epoch(e)` (the same).

    `move_to_device` (and `auto_transfer`): on a GPU rank each batch's tensors (in tuples,
    lists and mappings) are moved to the device, with non-blocking copies (`auto_transfer`:
    overlapped with compute where the loader pins memory; Ray copies on a second CUDA stream,
    the batches are the same). On CPU batches are untouched.

    The loader is rebuilt with its class's own constructor, from the loader's attributes of
    the constructor's parameter names (DataLoader keeps every argument as an attribute), rather
    than copied and patched: DataLoader refuses a new sampler once built, and a subclass (as
    StatefulDataLoader) sets itself up from its arguments in its constructor."""
    samplers = _sampling(data_loader, add_dist_sampler, seed)
    loader = _rebuild(data_loader, _prepared_class(type(data_loader)), samplers)
    device = get_device() if move_to_device else torch.device("cpu")
    loader._ft_device = None if device.type == "cpu" else device
    loader._ft_non_blocking = auto_transfer
    return loader


def _sampling(data_loader: DataLoader, add_dist_sampler: bool, seed: int) -> dict[str, Any]:
    """The sampling arguments of the prepared loader: this rank's DistributedSampler where
    `prepare_data_loader` adds one, else the loader's own sampler or batch sampler."""
    ctx = get_context()
    sampler, batch_sampler = data_loader.sampler, _custom_batch_sampler(data_loader)
    iterable = isinstance(data_loader.dataset, IterableDataset)
    shard = (
        add_dist_sampler
        and ctx.get_world_size() > 1
        and not iterable
        and not isinstance(sampler, DistributedSampler)
    )
    if shard:
        if batch_sampler is not None:
            raise ConfigError(
                f"prepare_data_loader: the loader has its own batch_sampler "
                f"({type(batch_sampler).__name__}), which cannot be sharded for it: build it "
                "over a DistributedSampler yourself and pass add_dist_sampler=False"
            )
        custom = not isinstance(sampler, (SequentialSampler, RandomSampler))
        if custom and ctx.get_world_rank() == 0:
            logger.warning(
                "prepare_data_loader: the loader's %s is replaced with a DistributedSampler "
                "(as Ray does); pass add_dist_sampler=False to keep it",
                type(sampler).__name__,
            )
        sampler = DistributedSampler(
            data_loader.dataset,
            num_replicas=ctx.get_world_size(),
            rank=ctx.get_world_rank(),
            shuffle=not isinstance(sampler, SequentialSampler),
            seed=seed,
        )
    if batch_sampler is not None:  # then batch_size and drop_last must be left at their defaults
        return {"batch_sampler": batch_sampler}
    batching = {"batch_size": data_loader.batch_size, "drop_last": data_loader.drop_last}
    return batching if iterable else {"sampler": sampler, **batching}


class _Prepared:
    """What `prepare_data_loader` adds to the loader's own class: ft-train's `set_epoch`, and
    the batches' move to the rank's GPU."""

    _ft_device: torch.device | None = None
    _ft_non_blocking = True

    def set_epoch(self, epoch: int) -> None:
        """`loader.sampler.set_epoch(epoch)`: the order of epoch `epoch`."""
        sampler = self.sampler  # type: ignore[attr-defined]
        if not hasattr(sampler, "set_epoch"):
            raise TypeError(
                f"loader.set_epoch: this loader's sampler ({type(sampler).__name__}) has no "
                "epoch. At one rank prepare_data_loader keeps the loader's own sampler, as Ray "
                "does: give the DataLoader a DistributedSampler(dataset, num_replicas=world_size, "
                "rank=rank, shuffle=True) for an order set by the epoch at every size (or call "
                "set_epoch only when get_context().get_world_size() > 1, as Ray's examples do); "
                "an IterableDataset orders itself"
            )
        sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()  # type: ignore[misc]
        if self._ft_device is None:
            return batches
        # map, not a generator: the loader's own __iter__ runs now (a StatefulDataLoader
        # tracks its iterator from there)
        return map(functools.partial(_to, self._ft_device, self._ft_non_blocking), batches)


_PREPARED: dict[type, type] = {}  # a loader class -> its prepared subclass, made once


def _prepared_class(cls: type) -> type:
    """`cls` with `_Prepared`'s additions (a prepared loader's class is its own)."""
    if issubclass(cls, _Prepared):
        return cls
    if cls not in _PREPARED:
        _PREPARED[cls] = type(f"Prepared{cls.__name__}", (_Prepared, cls), {"__module__": __name__})
    return _PREPARED[cls]


def _custom_batch_sampler(loader: DataLoader) -> Any:
    """The batch sampler the loader was given (`batch_sampler=`), else None: then DataLoader
    sets `batch_size` to None while keeping the batch sampler."""
    if loader.batch_size is None and loader.batch_sampler is not None:
        return loader.batch_sampler
    return None


def _rebuild(loader: DataLoader, cls: type, samplers: dict[str, Any]) -> DataLoader:
    """A `cls` built with `loader`'s constructor arguments, read back from its attributes, and
    `samplers` (the sampler arguments) instead of its own."""
    kwargs = {}
    for name in _init_parameters(type(loader)):
        if name in ("shuffle", "sampler", "batch_sampler", "batch_size", "drop_last"):
            continue  # the sampling arguments: `samplers`, and shuffle is the sampler's
        if not hasattr(loader, name):
            raise TypeError(
                f"prepare_data_loader rebuilds a {type(loader).__name__} from its constructor's "
                f"arguments, read back from its attributes, and it has no attribute {name!r}: "
                "keep each argument as an attribute of the same name, or shard it yourself "
                "(a DistributedSampler) and pass add_dist_sampler=False, move_to_device=False"
            )
        kwargs[name] = getattr(loader, name)
    return cls(**kwargs, **samplers)


def _init_parameters(cls: type) -> list[str]:
    """The named parameters of `cls`'s constructor; where it takes **kwargs, its bases' too,
    down to DataLoader's."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names += [p.name for p in params if p.kind in named and p.name not in names]
        if klass is DataLoader or not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _to(device: torch.device, non_blocking: bool, batch: Any) -> Any:
    """`batch` with its tensors on `device`, in the same containers."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: _to(device, non_blocking, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to(device, non_blocking, b) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(device, non_blocking, b) for b in batch)
    return batch


def __getattr__(name: str) -> Any:
    # Ray Train's `ray.train.torch` names that ft-train does not offer: refused naming what to
    # use instead (`ft_train.ray_names`).
    import sys

    from . import ray_names

    return ray_names.module_attribute(sys.modules[__name__], name)


# Ray's ray.train.torch.TorchTrainer; it imports no Prefect (its fit() finds the flow by entry point)
from .trainer import TorchTrainer as TorchTrainer  # noqa: E402
