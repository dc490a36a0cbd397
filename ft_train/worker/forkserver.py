"""A Dask nanny preload, for clusters ft-train does not start (`ft-train dask-config`): the worker
processes a nanny starts fork from a server that has imported torch already, as the workers of
ft-train's own local clusters do (`driver.cluster`). A worker that replaces a lost one then joins
with torch imported, at once and without the seconds of CPU that importing torch takes: where
the node has no core to spare, those seconds were taken from the ranks still training (the
first 5 s after each restart ran at 65 % of the pace, bench/README.md).

The server starts with the nanny's first worker, after the nanny has set its pre-spawn-environ
(MALLOC_ARENA_MAX, ...): the forked workers start with those, as spawned ones would.
"""

from __future__ import annotations

from distributed.utils import get_mp_context

from ..compat import forkserver
from .warm import TORCH


def dask_setup(nanny) -> None:
    ctx = get_mp_context()  # Dask's own list first (distributed and what it imports)
    if ctx.get_start_method() != "forkserver":
        return
    have = forkserver.preload_modules()
    ctx.set_forkserver_preload(have + [m for m in TORCH if m not in have])
