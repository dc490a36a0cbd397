"""torch.distributed beyond its public API.

- `control_group()`: ft-train's own gloo group for report()'s agreement
  (`ft_train.worker.preemption`), beside the user's default group. Where the default group is
  gloo, the control group shares its device and runs one thread: each gloo device runs a thread
  that wakes about every 10 ms whether or not anything is sent, and a second device would add a
  second such thread to every rank, on the training thread's core when the ranks fill the cores.
  torch has no public way to build a gloo group on another group's device with one thread
  (`dist.new_group(backend="gloo")` makes a device of its own): the group is built from
  `ProcessGroupGloo._Options` and the default group's store (`_get_default_store`).
- `default_store()`: the default group's rendezvous store, where the ranks of a GPU run tell each
  other which devices they see (`ft_train.worker.devices.host_devices`); torch does not expose it.
- `import_dynamo()`: the first DDP imports `torch._dynamo`, which takes seconds; imported when the
  process group starts, so that it is not counted in a rank's first report's time (the watchdog).

Checked on torch 2.4 to 2.14; pyproject.toml bounds torch below 2.15.
"""

from __future__ import annotations

from typing import Any

# What tests/unit/test_private_apis.py checks: (object path, attribute).
PRIVATE_NAMES = (
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
    ("torch.distributed.ProcessGroup", "_get_backend"),
    ("torch.distributed.ProcessGroupGloo", "_Options"),
    ("torch.distributed.ProcessGroupGloo._Options instance", "_devices"),
    ("torch.distributed.ProcessGroupGloo._Options instance", "_timeout"),
    ("torch.distributed.ProcessGroupGloo._Options instance", "_threads"),
    ("torch", "_dynamo"),
)


def import_dynamo() -> None:
    import torch._dynamo  # noqa: F401


def default_store() -> Any:
    import torch.distributed

    dist: Any = torch.distributed  # as in control_group
    return dist.distributed_c10d._get_default_store()


def control_group() -> Any:
    """A gloo group of all ranks, in the same order, on the default group's gloo device with one
    thread where the default group is gloo; else a new gloo group."""
    import torch
    import torch.distributed

    dist: Any = torch.distributed  # the private names below are not in torch's type stubs

    if dist.get_backend() != "gloo":
        return dist.new_group(backend="gloo")
    default = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options
    options = dist.ProcessGroupGloo._Options()
    options._devices, options._timeout, options._threads = default._devices, default._timeout, 1
    store = dist.PrefixStore("ft-train-control", default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), options)
