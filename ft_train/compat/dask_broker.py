"""distributed's scheduler event broker, beyond its public API.

Every rank's report reaches the driver as a Dask event (`Client.log_event`) on a topic of its own.
The scheduler keeps the last `distributed.admin.low-level-log-length` events of every topic for
late subscribers (`get_events`), which ft-train never reads: at a report a step on a thousand
ranks that is memory and time for nothing. The public setting is one length for all topics,
the scheduler's own included; only the broker's topic table (`Scheduler._broker._topics`, a
defaultdict of `Topic`s whose `events` is a deque) can keep none for ft-train's topic alone.
Checked on distributed 2026.8 to 2026.12; pyproject.toml bounds distributed below 2027.
"""

from __future__ import annotations

import collections
from typing import Any

# What tests/unit/test_private_apis.py checks: (object path, attribute).
PRIVATE_NAMES = (
    ("distributed.Scheduler instance", "_broker"),
    ("distributed.broker.Broker instance", "_topics"),
    ("distributed.broker.Topic instance", "events"),
)


def keep_no_events(scheduler: Any, topic: str) -> None:
    """On the scheduler (a `Client.run_on_scheduler` function's `dask_scheduler`): keep none of
    `topic`'s events once they are sent to its subscribers. A version of distributed without
    the broker keeps them, as before: slower, never wrong."""
    broker = getattr(scheduler, "_broker", None)
    if broker is not None:
        broker._topics[topic].events = collections.deque(maxlen=0)
