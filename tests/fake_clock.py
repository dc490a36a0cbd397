"""A clock for the controller (`ft_train.controller.clock.Clock`) whose time moves only when the
controller would wait, or when a test moves it: a test of a deadline then takes no wall-clock
time, and a loaded machine cannot make it flaky."""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


class NothingToWaitFor(AssertionError):
    """The controller would wait for an event with none queued and no deadline: a real one
    would block for ever, so the test is missing an event."""


class FakeClock:
    def __init__(self, epoch: float = 1_800_000_000.0):
        self.now = 0.0  # monotonic seconds
        self.epoch = epoch  # what time() says at monotonic 0
        self.waits: list[float] = []  # every wait that ran out, in seconds

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.epoch + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def next_event(self, events: queue.Queue[T], timeout: float | None) -> T:
        """The queued event at once; with none queued, the whole `timeout` passes."""
        try:
            return events.get_nowait()
        except queue.Empty:
            if timeout is None:
                raise NothingToWaitFor(
                    "the controller waits for an event, none is queued and no deadline is set"
                ) from None
            self.now += timeout
            self.waits.append(timeout)
            raise
