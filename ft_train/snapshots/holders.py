"""The driver's side of the in-memory snapshot tier: who holds each rank's snapshots, and what
the holders hold (`store`).

Each rank's piece has two holders where the cluster has them: the rank's own nanny, which
outlives the rank's process, and a peer worker's nanny (the worker itself where it has none),
which outlives the rank's node: on another host where the cluster has one, else the next rank's,
in a ring. With a single worker, its own nanny alone. Queries go to every holder at once, each
given knobs.ANSWER_TIMEOUT_S: a silent holder's pieces count as lost.

A holder that is gone or silent is not asked again for the rest of the run (the caller keeps the
set, `dead`): each question to it would cost the full knobs.ANSWER_TIMEOUT_S, as the client's
connection pool retries a refused connection until its own connect timeout, fixed when the pool
was made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

from distributed import Client

from .. import knobs
from .piece import SnapshotPiece
from .store import handler

logger = logging.getLogger("ft_train")


def holder_of(worker: dict[str, Any], address: str) -> str:
    """Where a worker's held pieces live: its nanny, which outlives it, else itself."""
    return worker.get("nanny") or address


def place_holders(addresses: list[str], workers: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The holders of each rank's pieces (in rank order): its own nanny, if it has one, and the
    first other worker's holder, in ring order from the next rank and then the cluster's
    workers outside the group, on another host, else the first other worker. None at all: no
    snapshots."""
    others = sorted(a for a in workers if a not in addresses)
    out: list[list[str]] = []
    for r, addr in enumerate(addresses):
        ring = [*addresses[r + 1 :], *addresses[:r], *others]
        host = workers[addr]["host"]
        peer = next((a for a in ring if workers[a]["host"] != host), ring[0] if ring else None)
        own = workers[addr].get("nanny")
        holders = [own] if own else []
        if peer is not None and holder_of(workers[peer], peer) not in holders:
            holders.append(holder_of(workers[peer], peer))
        out.append(holders)
    return out


def all_holders(client: Client) -> list[str]:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return sorted({holder_of(w, a) for a, w in workers.items()})


def _ask(client: Client, op: str, also: Collection[str], dead: set[str], **kwargs: Any) -> list:
    """`op` on every holder of the cluster, and those in `also`, at once, but those in `dead`;
    the answers of those that gave one. One that is gone or silent is added to `dead`."""

    async def one(addr: str) -> Any:
        call = getattr(client.rpc(addr), handler(op))(**kwargs)
        try:
            return await asyncio.wait_for(call, knobs.ANSWER_TIMEOUT_S)
        except (TimeoutError, OSError) as e:  # gone or frozen: it holds nothing usable
            dead.add(addr)
            logger.info("ft-train: snapshot holder %s is not asked again: %r", addr, e)
        except Exception as e:  # without the handler (not set up yet): it holds nothing
            logger.debug("ft-train: snapshot holder %s: %r", addr, e)
        return None

    # here: in the event loop, a sync client's info is cached
    holders = sorted((set(all_holders(client)) | set(also)) - dead)

    async def every() -> list[Any]:
        return await asyncio.gather(*(one(a) for a in holders))

    return [a for a in client.sync(every) if a is not None]


def held(
    client: Client, run: str, also: Collection[str] = (), dead: set[str] | None = None
) -> list[SnapshotPiece]:
    """Every piece held for `run`, a copy each (as the holders describe them, unchecked: the
    restoring rank checks the bytes)."""
    answers = _ask(client, "describe", also, set() if dead is None else dead, run=run)
    return [
        SnapshotPiece.from_dict(p)
        for answer in answers
        if isinstance(answer, (list, tuple))
        for p in answer
    ]


def drop(
    client: Client, run: str, also: Collection[str] = (), dead: set[str] | None = None
) -> None:
    """Forget `run`'s pieces (the run has ended)."""
    _ask(client, "drop", also, set() if dead is None else dead, run=run)
