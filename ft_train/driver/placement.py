"""Placement: which of the cluster's workers get an attempt's ranks, and when there are enough.
A worker is usable unless excluded (suspected of a fault) or, for a GPU run, without a GPU;
ranks go to usable workers in address order."""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed import Client

from .. import knobs
from ..controller.ports import GroupPlan
from ..errors import WorkerStartupError
from ..policy.elastic import enough, should_grow
from ..worker.rank import free_port
from . import job_queue

logger = logging.getLogger("ft_train")


def _rank_of(workers: dict[str, dict]) -> list[str]:
    """Worker addresses in rank order: grouped by host, then by worker name."""
    return sorted(workers, key=lambda a: (workers[a]["host"], str(workers[a].get("name")), a))


def _usable(workers: dict[str, dict], use_gpu: bool, exclude: set[str]) -> dict[str, dict]:
    """Workers a rank may use. With use_gpu, those with a GPU resource, if the cluster marks any."""
    usable = {a: w for a, w in workers.items() if a not in exclude}
    gpu = {a: w for a, w in usable.items() if w.get("resources", {}).get("GPU", 0) >= 1}
    return gpu if use_gpu and gpu else usable


def free_ports(client: Client, addrs: list[str]) -> dict[str, int]:
    """A free port on each of the workers that answer within knobs.ANSWER_TIMEOUT_S. One that does not
    is frozen (its process stopped, its machine hung) or its event loop is busy (a warm import
    of torch in a worker that just joined): it is not given a rank now. Each worker is asked
    on its own, all at once: one call to all of them tells nothing when one is silent, and
    asking them one by one would wait knobs.ANSWER_TIMEOUT_S for every silent one."""

    def ask(addr: str) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):
            return client.run(
                free_port,
                workers=[addr],
                on_error="return",
                callback_timeout=knobs.ANSWER_TIMEOUT_S,
            )
        return {}

    with ThreadPoolExecutor(max_workers=min(32, len(addrs) or 1)) as pool:
        answers = {a: p for answer in pool.map(ask, addrs) for a, p in answer.items()}
    return {a: p for a, p in answers.items() if isinstance(p, int)}


def await_workers(
    client: Client, plan: GroupPlan, exclude: set[str]
) -> tuple[list[str], dict[str, int], dict[str, Any]]:
    """The workers for a new group, in rank order, a free port on each (rank 0's is the
    rendezvous), and the scheduler's word on every worker when they were chosen (the group
    needs theirs: one may be gone by the time it asks again): `max_workers` if they are there
    within `elastic_wait_s`, else as many as there are once at least `min_workers` are; waits up
    to `start_timeout_s` for `min_workers`. Only workers that answer count: a frozen one given a
    rank would hold the others' rendezvous until the scheduler drops it (worker-ttl)."""
    start, warned = time.monotonic(), set[str]()
    sizes = (plan.min_workers, plan.max_workers, plan.elastic_wait_s)
    while True:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        usable = _rank_of(_usable(workers, plan.use_gpu, exclude))
        waited = time.monotonic() - start
        ready, silent = usable, []
        if enough(len(usable), waited, *sizes):
            ports = free_ports(client, usable)
            ready = [a for a in usable if a in ports]
            if enough(len(ready), waited, *sizes):
                return ready[: plan.max_workers], ports, workers
            silent = [a for a in usable if a not in ports]
            if set(silent) - warned:
                logger.warning("ft-train: workers %s do not answer; waiting for others", silent)
                warned |= set(silent)
        if waited > plan.start_timeout_s:
            also = f" ({len(silent)} more did not answer: frozen or busy)" if silent else ""
            if exclude:
                also += f" ({len(exclude)} lost or killed in this run's earlier attempts)"
            raise WorkerStartupError(
                f"only {len(ready)} of {plan.min_workers} Dask workers were available after "
                f"{plan.start_timeout_s:.0f}s{also} (scheduler {client.scheduler.address}); add "
                "workers, or raise scaling_config.worker_start_timeout_s"
                + job_queue.waiting_jobs(client)
            )
        time.sleep(0.05)  # polling the scheduler's worker list; bounded by the deadlines


def more_workers_available(
    client: Client, plan: GroupPlan, current: list[str], exclude: set[str]
) -> bool:
    """Could a group grow: fewer ranks than max_workers, and an idle usable worker?"""
    if len(current) >= plan.max_workers:
        return False
    usable = _usable(client.scheduler_info(n_workers=-1)["workers"], plan.use_gpu, exclude)
    return should_grow(len(current), plan.max_workers, len(set(usable) - set(current)))
