"""Torch helpers for the training function: device placement, DDP or FSDP, data sharding, and
sharded checkpoints (torch.distributed.checkpoint).

`prepare_data_loader` gives each rank its shard through a `DistributedSampler` (also at world
size 1, so the shuffle order depends only on seed and epoch) and sets the sampler's epoch on each
pass. Call `loader.set_epoch(e)` when resuming mid-run so the order matches an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from .errors import ConfigError
from .worker.session import get_context


def get_device() -> torch.device:
    """`cuda` when the rank has a GPU (ScalingConfig.use_gpu), else `cpu`."""
    if torch.cuda.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_model(
    model: torch.nn.Module,
    parallel_strategy: Literal["ddp", "fsdp"] = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move the model to this rank's device and make it data-parallel.

    "ddp" (the default): wrapped in DistributedDataParallel when there is more than one rank
    (`parallel_strategy_kwargs` go to it: find_unused_parameters=True, ...). "fsdp": sharded with
    FSDP2's `fully_shard` at the root, also on one rank, so that its state dict is DTensors
    whatever the size (`parallel_strategy_kwargs` go to `fully_shard`: reshard_after_forward,
    mp_policy, ...); call `fully_shard` on the blocks you want as units first (each transformer
    block, as torchtitan does). FSDP2 runs on CPU with gloo; FSDP1 needs a GPU. Save an FSDP
    model with `save_sharded` (every rank its shard)."""
    if parallel_strategy not in ("ddp", "fsdp"):
        raise ConfigError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}): give 'ddp' or 'fsdp'"
        )
    kwargs = dict(parallel_strategy_kwargs or {})
    device = get_device()
    model = model.to(device)
    if parallel_strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, **kwargs)  # in place: the model's class becomes an FSDPModule
        return model
    if get_context().get_world_size() > 1:
        kwargs.setdefault("device_ids", [device.index] if device.type == "cuda" else None)
        model = DistributedDataParallel(model, **kwargs)
    return model


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


class ShardedLoader:
    """A DataLoader over this rank's shard; iterating it advances the sampler's epoch."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, device: torch.device):
        self.loader, self.sampler, self.device = loader, sampler, device
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for batch in self.loader:
            yield _to(batch, self.device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _to(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def prepare_data_loader(loader: DataLoader, seed: int = 0) -> ShardedLoader:
    """Rebuild `loader` over this rank's shard (a DistributedSampler), keeping its other settings."""
    ctx = get_context()
    sampler: DistributedSampler = DistributedSampler(
        loader.dataset,
        num_replicas=ctx.get_world_size(),
        rank=ctx.get_world_rank(),
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
    )
    rebuilt = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )
    return ShardedLoader(rebuilt, sampler, get_device())


# Ray's ray.train.torch.TorchTrainer; it imports no Prefect (its fit() finds the flow by entry point)
from .trainer import TorchTrainer as TorchTrainer  # noqa: E402
