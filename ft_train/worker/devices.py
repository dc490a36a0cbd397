"""What a rank sees of its machine as torchrun would show it: the torchrun variables, and which
GPU is its own.

`torchrun_environ` is what torchrun sets for a worker (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK/GROUP_RANK, MASTER_ADDR, MASTER_PORT): code written for torchrun
(Hugging Face Trainer, Accelerate, Lightning) finds the group it expects, already initialised.

`pick_device` is a pure function of the GPUs each rank on a host can see (their physical ids,
in each process's own numbering), so that it is tested on CPU. In local-rank order, each rank
takes the first GPU it sees that no rank before it took. A worker given its own GPU first in
CUDA_VISIBLE_DEVICES (a SpecCluster of one-GPU nannies; dask-cuda's LocalCUDACluster and `dask
cuda worker`, which rotate the list so that device 0 is each worker's own) gets device 0, its
own; ranks that see the same GPUs (none set, or one list for the host, as a SLURM job with
several GPUs sets it) get `cuda:LOCAL_RANK`, as under torchrun; two SLURM jobs on one node whose
cgroups each show their own GPUs as 0, 1 get theirs. (`set_device(local_rank)` alone put two
LocalCUDACluster ranks on one GPU.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError


def torchrun_environ(
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """The variables torchrun sets in each worker process, for this rank."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),  # Lightning's name
        "GROUP_RANK": str(node_rank),  # torchrun's
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def pick_device(local_rank: int, host_devices: Sequence[Sequence[str]], host: str = "") -> int:
    """This rank's CUDA device index, in its own process's numbering. `host_devices[i]`: the
    physical GPUs (ids) the rank of local rank i on this host sees, in its numbering. Raises
    ConfigError when this rank has none left."""
    taken: set[str] = set()
    for i, devices in enumerate(host_devices):
        free = [d for d in devices if d not in taken]
        if i == local_rank:
            if free:
                return list(devices).index(free[0])
            raise ConfigError(
                f"scaling_config.use_gpu: local rank {i} on host {host!r} finds "
                f"{'no GPU' if not devices else 'no GPU that a rank before it did not take'} "
                f"(it sees {list(devices)}); run one worker per GPU on each host (or give each "
                "its own CUDA_VISIBLE_DEVICES), or set use_gpu=False"
            )
        if free:
            taken.add(free[0])
    raise IndexError(f"local rank {local_rank} is not among the host's {len(host_devices)}")


def visible_devices() -> list[str]:
    """The physical ids (UUIDs) of the GPUs this process sees, in its CUDA numbering."""
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def host_devices(store: Any, node_rank: int, local_rank: int, local_world: int) -> list[list[str]]:
    """`visible_devices()` of every rank on this host, by local rank, exchanged through the
    group's rendezvous store (each rank sets its own key, then reads its host's)."""
    prefix = f"ft-train/devices/{node_rank}/"
    store.set(prefix + str(local_rank), json.dumps(visible_devices()))
    return [json.loads(store.get(prefix + str(i))) for i in range(local_world)]
