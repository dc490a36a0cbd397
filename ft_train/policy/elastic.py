"""The elastic size: how many workers a group starts with, and when a running group grows."""

from __future__ import annotations


def enough(
    available: int, waited_s: float, min_workers: int, max_workers: int, elastic_wait_s: float
) -> bool:
    """May a group start with `available` workers after waiting `waited_s`: all it can use, or
    at least its minimum once `elastic_wait_s` has passed."""
    return available >= max_workers or (available >= min_workers and waited_s >= elastic_wait_s)


def should_grow(ranks: int, max_workers: int, idle_usable: int) -> bool:
    """After a checkpoint: stop a group below its maximum, to start a larger one from that
    checkpoint, when usable workers are idle (a resize, not a failure)."""
    return ranks < max_workers and idle_usable > 0
