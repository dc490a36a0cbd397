"""Warm workers: import what a rank needs as soon as a worker joins, not when a rank starts.

Importing torch takes seconds; a worker that joins to replace a lost one (a nanny's restart, a
new node, the spare of a local cluster) would otherwise pay it inside the next group's start,
while every other rank waits. The imports run in the worker's event loop when the plugin is set
up, before the worker runs a task; a rank never imports torch concurrently with them (torch's
import is not safe to race from two threads: it crashed workers).

A local cluster's workers get the plugin at start, before they join the scheduler (so the
cluster's start, which the flow overlaps with Prefect's, pays the imports); on any other cluster
the controller registers it with the scheduler, for the workers there and those that join later.
"""

from __future__ import annotations

import importlib
import logging

from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger("ft_train")

# torch._dynamo: the first DDP imports it (about a second), so a rank would pay it mid-start
TORCH = ("torch", "torch.distributed", "torch._dynamo")


class WarmImports(WorkerPlugin):
    """Installed on every worker of the run's cluster, and on those that join later."""

    name = "ft-train-warm-imports"

    def __init__(self, modules: tuple[str, ...] = TORCH):
        self.modules = modules

    def setup(self, worker) -> None:
        for module in self.modules:
            try:
                importlib.import_module(module)
            except Exception as e:  # the rank's own import reports it properly
                logger.debug("warm import of %s failed: %s", module, e)
