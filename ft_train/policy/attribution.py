"""Failure attribution: which rank, and which kind of failure, a group failure is charged to.

When one rank fails, its peers fail too, often first (gloo sees the closed connection at once).
A rank whose error says it lost a peer is a suspect, not a cause: the controller waits
`COLLATERAL_WAIT_S` for the cause's own signal (a lost worker, a killed process, a hung peer)
and judges it with `judge_suspect` if none came.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Literal

_PEER_LOST = ("connection closed by peer", "connection reset by peer", "timed out")

# "lost": a rank's worker is gone; the group tells a lost process from a lost node
Kind = Literal["exception", "lost", "hang", "preemption"]


def lost_a_peer(error: str) -> bool:
    """Does a rank's error say it failed because a peer went away (or went silent)?"""
    return any(p in error.lower() for p in _PEER_LOST)


def hung_rank(
    ranks: Iterable[int],
    done: Container[int],
    waiting: int | None,
    received: dict[int, int],
    progress: dict[int, float],
) -> int | None:
    """The rank to blame when the watchdog fires: of the ranks still running, except `waiting`
    (one that failed waiting for a peer), the one with the fewest reports received, then the
    one heard from least recently; a rank never heard from at all (`received` and `progress`
    lack it) first. `waiting` itself when every other rank has returned."""
    running = [r for r in ranks if r not in done and r != waiting]
    return min(running, key=lambda r: (received.get(r, 0), progress.get(r, 0.0)), default=waiting)


def laggard(
    ranks: Iterable[int], done: Container[int], rank: int, step: int, received: dict[int, int]
) -> int | None:
    """When `rank` timed out in a collective at `step`: the rank it waited for, one still
    running and not ahead of it (the furthest behind first), if any."""
    running = [r for r in ranks if r not in done and r != rank]
    lagging = [r for r in running if received.get(r, 0) <= step]
    return min(lagging, key=lambda r: received.get(r, 0), default=None)


@dataclass(frozen=True)
class Blame:
    """What a group failure is charged to."""

    kind: Kind
    rank: int | None
    error: str = ""


def judge_suspect(
    rank: int, error: str, preempting: bool, gone: int | None, lagging: int | None
) -> Blame:
    """A rank that lost a peer, and no word of the cause came within COLLATERAL_WAIT_S:
    workers leaving explain it (a preemption); else a group worker the scheduler no longer
    lists (`gone`: its lost event is late); else, for a collective that timed out, the rank
    it waited for (`lagging`: a hang); else the rank itself."""
    if preempting:
        return Blame("preemption", None)
    if gone is not None:
        return Blame("lost", gone)
    if lagging is not None and "timed out" in error.lower():
        return Blame("hang", lagging, f"no progress; rank {rank} timed out waiting for it")
    return Blame("exception", rank, error)
