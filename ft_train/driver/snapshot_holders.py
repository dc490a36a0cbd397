"""The driver's side of the in-memory snapshot tier: who holds each rank's snapshots, and what
the holders hold (`ft_train.worker.snapshot_store`).

A rank's holder is a peer worker's nanny (the worker itself where it has none): on another host
where the cluster has one, else the next rank's, in a ring, so that no two ranks' pieces depend
on the same worker more than the ring makes them; with a single worker, its own nanny. Queries
go to every holder at once, each given knobs.ANSWER_TIMEOUT_S: a silent holder's pieces count as
lost (its round is incomplete).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

import dask
from distributed import Client

from .. import knobs

logger = logging.getLogger("ft_train")


def holder_of(worker: dict[str, Any], address: str) -> str:
    """Where a worker's held pieces live: its nanny, which outlives it, else itself."""
    return worker.get("nanny") or address


def place_holders(addresses: list[str], workers: dict[str, dict[str, Any]]) -> list[str | None]:
    """The holder of each rank's pieces (in rank order): the first other worker, in ring order
    from the next rank and then the cluster's workers outside the group, on another host; else
    the first other worker; else the rank's own nanny; else None (no snapshots)."""
    others = sorted(a for a in workers if a not in addresses)
    out: list[str | None] = []
    for r, addr in enumerate(addresses):
        ring = [*addresses[r + 1 :], *addresses[:r], *others]
        host = workers[addr]["host"]
        peer = next((a for a in ring if workers[a]["host"] != host), ring[0] if ring else None)
        if peer is not None:
            out.append(holder_of(workers[peer], peer))
        else:
            out.append(workers[addr].get("nanny"))
    return out


def all_holders(client: Client) -> list[str]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return sorted({holder_of(w, a) for a, w in workers.items()})


def _ask(client: Client, op: str, also: Collection[str], **kwargs: Any) -> list[Any]:
    """`op` on every holder of the cluster, and those in `also`, at once; the answers of those
    that gave one."""

    async def one(addr: str) -> Any:
        call = getattr(client.rpc(addr), f"ft_train_snapshot_{op}")(**kwargs)
        try:
            return await asyncio.wait_for(call, knobs.ANSWER_TIMEOUT_S)
        except Exception as e:  # gone, frozen, or without the handler: it holds nothing usable
            logger.debug("ft-train: snapshot holder %s: %s", addr, e)
            return None

    holders = sorted(
        set(all_holders(client)) | set(also)
    )  # here: in the event loop, a sync client's info is cached

    async def every() -> list[Any]:
        return await asyncio.gather(*(one(a) for a in holders))

    with dask.config.set({"distributed.comm.timeouts.connect": knobs.KILL_CONNECT_TIMEOUT}):
        return [a for a in client.sync(every) if a is not None]


def held(client: Client, run: str, also: Collection[str] = ()) -> list[dict[str, Any]]:
    """Every piece held for `run`, each checked against its sha256 by its holder."""
    return [
        p
        for answer in _ask(client, "describe", also, run=run)
        if isinstance(answer, (list, tuple))
        for p in answer
    ]


def drop(client: Client, run: str, also: Collection[str] = ()) -> None:
    """Forget `run`'s pieces (the run has ended)."""
    _ask(client, "drop", also, run=run)
