"""Torch helpers for the training function: device placement, DDP, and data sharding.

`prepare_data_loader` gives each rank its shard through a `DistributedSampler` (also at world
size 1, so the shuffle order depends only on seed and epoch) and sets the sampler's epoch on each
pass. Call `loader.set_epoch(e)` when resuming mid-run so the order matches an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from .worker.session import get_context


def get_device() -> torch.device:
    """`cuda` when the rank has a GPU (ScalingConfig.use_gpu), else `cpu`."""
    if torch.cuda.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Move the model to this rank's device; wrap it in DDP when there is more than one rank."""
    device = get_device()
    model = model.to(device)
    if get_context().get_world_size() > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    return model


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
