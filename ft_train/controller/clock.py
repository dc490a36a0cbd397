"""The controller's clock: the one place it reads the time or waits.

Every deadline the controller keeps (the hang watchdog, a suspect's judgement, a preemption
notice, the drain of the last reports) is read from a `Clock`, and every wait for the next
group event goes through `Clock.next_event`. A test gives the controller a clock of its own
(tests/fake_clock.py) whose time moves only when the controller would wait: a test of a deadline
then takes no wall-clock time and cannot be made flaky by a loaded machine.
"""

from __future__ import annotations

import queue
import time
from typing import Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: the controller's own deadlines."""
        ...

    def time(self) -> float:
        """Epoch seconds: deadlines that come from elsewhere (a worker's preemption notice)."""
        ...

    def next_event(self, events: queue.Queue[T], timeout: float | None) -> T:
        """The next item of `events`, waiting at most `timeout` seconds (None: until one
        comes); raises `queue.Empty` when the time ran out first."""
        ...


class SystemClock:
    """The machine's clocks, and a blocking wait on the queue."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def next_event(self, events: queue.Queue[T], timeout: float | None) -> T:
        return events.get(timeout=timeout)
