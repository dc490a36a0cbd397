"""Warm workers: import what a rank needs as soon as a worker joins, not when a rank starts.

Importing torch takes seconds; a worker that joins to replace a lost one (a nanny's restart, a
new node, the spare of a local cluster) would otherwise pay it inside the next group's start,
while every other rank waits. The controller registers this plugin once its first group is up:
workers running a rank have imported all of it already, the others import it then, and workers
that join later import it before they run a task.

The imports run in the worker's event loop, never beside a rank's own imports: torch's import
is not safe to race from two threads (it crashed workers).
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
