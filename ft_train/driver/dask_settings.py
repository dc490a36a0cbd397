"""ft-train's Dask settings: what fault tolerance and the ranks' pace depend on, in force in the
clusters ft-train starts (`driver.cluster`), written out for those it does not (`ft-train
dask-config`), and checked in those at connect (`warn_if_not_in_force`).

- `allowed-failures: 0`: Dask must never re-run a rank whose worker died; the group restarts.
- `worker.daemon: False`: a rank may start processes (`DataLoader(num_workers>0)`).
- the rest keep Dask's own timers, profiler and allocator settings off the ranks' cores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dask

from .. import knobs

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger("ft_train")

DASK_SETTINGS = {
    "distributed.scheduler.allowed-failures": 0,
    "distributed.worker.daemon": False,
    "distributed.scheduler.worker-ttl": "60s",
    # A LocalCluster/SpecCluster closes a nanny whose worker has not come back this long after
    # it was lost; with a worker killed twice in a row, the cluster would shrink for good.
    "distributed.deploy.lost-worker-timeout": "1h",
    # Worker processes read this when they import distributed. A failed rank is reported by the
    # controller, with its traceback; Dask's own "Compute Failed" would say it twice.
    "distributed.nanny.pre-spawn-environ.DASK_LOGGING__DISTRIBUTED": "critical",
    # Dask sets MALLOC_TRIM_THRESHOLD_=65536 in worker processes, which turns off glibc's
    # adaptive mmap threshold: every large tensor becomes a fresh mmap and its page faults.
    # None unsets it. (The figures behind these settings: bench/README.md.)
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    # A rank trains on a Dask executor thread, and glibc gives such a thread an arena of its own,
    # made of 64 MB heaps. When a step's allocations cross a heap's end, every step maps a fresh
    # heap for one gradient and unmaps it when it is freed. One arena: the rank allocates from
    # the process's main heap, as bare DDP's main thread does.
    "distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX": 1,
    # The statistical profiler samples every thread's stack every 10 ms, the rank's included.
    "distributed.worker.profile.enabled": False,
    # Every scheduler, nanny and worker wakes its event loop every 20 ms to time it (for a
    # "blocked event loop" warning after 3 s) and every 0.5 s to sample the system (dashboard
    # metrics), taking the ranks' cores and GIL.
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    # Each rank's task is bound to its worker, and holds no data: work stealing (a scheduler
    # callback every second) and the active memory manager (every 2 s) have nothing to do.
    "distributed.scheduler.work-stealing": False,
    "distributed.scheduler.active-memory-manager.start": False,
}


# For a cluster ft-train does not start: a nanny starts each worker process from a fork server,
# as ft-train's own local clusters do (`driver.cluster`). `dask worker` ignores the preloads of
# the config, so its command line names them too (docs/clusters.md):
# --preload-nanny ft_train.worker.forkserver (torch in the fork server) and
# --preload ft_train.driver.cluster (a rank's DataLoader processes fork from it).
EXTERNAL_SETTINGS = {
    "distributed.worker.multiprocessing-method": "forkserver",
    "distributed.nanny.preload": ["ft_train.worker.forkserver"],
    "distributed.worker.preload": ["ft_train.driver.cluster"],
}


def dask_config() -> dict:
    """DASK_SETTINGS and EXTERNAL_SETTINGS as a nested Dask config (what `ft-train dask-config`
    writes as YAML), for a scheduler and workers that ft-train does not start: they read it from
    a file in DASK_CONFIG or /etc/dask. Environment variables cannot carry the nanny's
    pre-spawn-environ (Dask lower-cases their keys)."""
    config: dict = {}
    # writes into `config`, not Dask's own
    dask.config.set({**DASK_SETTINGS, **EXTERNAL_SETTINGS}, config=config)
    return config


# The workers' settings, asked in a worker process (the nanny's are in its worker's config
# too: both read the same files).
WORKER_KEYS = [
    k
    for k in DASK_SETTINGS
    if k.startswith(("distributed.worker.", "distributed.nanny.", "distributed.admin."))
]


def _scheduler_lacking() -> Callable[..., list[str]]:
    """A function that says which of the scheduler's settings that matter most it started
    without, from its own attributes (a scheduler may run in the driver's process, whose
    config the run changes). A closure: pickled by value, for a scheduler without ft-train."""
    from dask.utils import parse_timedelta

    failures = DASK_SETTINGS["distributed.scheduler.allowed-failures"]
    ttl = parse_timedelta(str(DASK_SETTINGS["distributed.scheduler.worker-ttl"]))

    def lacking(dask_scheduler: Any) -> list[str]:
        return [
            key
            for key, ok in (
                (
                    "distributed.scheduler.allowed-failures",
                    dask_scheduler.allowed_failures == failures,
                ),
                ("distributed.scheduler.worker-ttl", dask_scheduler.worker_ttl == ttl),
            )
            if not ok
        ]

    return lacking


def _lacking(keys: list[str]) -> Callable[[], list[str]]:
    """A function that says which of `keys` the process it runs in lacks (a closure)."""
    wanted = {k: DASK_SETTINGS[k] for k in keys}

    def lacking() -> list[str]:
        import dask

        missing = object()
        return [k for k, v in wanted.items() if dask.config.get(k, default=missing) != v]

    return lacking


def warn_if_not_in_force(client: Client) -> None:
    """A scheduler or workers that ft-train did not start read their own settings: say which of
    ft-train's they lack, and how to start them with all (a warning: the run works without, but
    a scheduler with Dask's default allowed-failures re-runs a rank whose worker died, and a
    worker with Dask's profiler and timers trains up to 30 % slower, bench/README.md). The
    workers there now are asked; those that join later are not."""
    try:
        timeout = knobs.ANSWER_TIMEOUT_S
        scheduler = client.run_on_scheduler(_scheduler_lacking(), callback_timeout=timeout)
        workers = client.run(_lacking(WORKER_KEYS), on_error="ignore", callback_timeout=timeout)
    except Exception as e:  # a scheduler that refuses pickled calls: it cannot be asked
        logger.debug("cannot read the cluster's Dask settings: %s", e)
        return
    wlack = sorted(set().union(*workers.values()))
    if not scheduler and not wlack:
        return
    logger.warning(
        "ft-train: the Dask cluster at %s was started without ft-train's Dask settings: the "
        "scheduler lacks %s; %d of %d workers lack %s. Without allowed-failures=0 the scheduler "
        "re-runs a rank whose worker died; without the rest ranks train up to 30%% slower. Start "
        "the scheduler and the workers with the file `ft-train dask-config` prints, in /etc/dask/ "
        "or DASK_CONFIG (docs/clusters.md)",
        *(client.scheduler.address, ", ".join(scheduler) or "none"),
        *(sum(1 for keys in workers.values() if keys), len(workers), ", ".join(wlack) or "none"),
    )
