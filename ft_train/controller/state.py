"""Controller states. Each is a small class carrying its data; two are terminal.

    Idle ──start──▶ Running ──all ranks done──▶ Finished
     ▲                │
     └──RETRY─────────┤ a rank failed: stop the group, record, ask the failure policy
                      └──RAISE──▶ Errored
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import TrainingFailedError
from ..run_state import FailureRecord
from ..worker_group import WorkerGroup


@dataclass
class Idle:
    """No group runs; the next segment starts one from the latest committed checkpoint."""

    after_failure: Optional[FailureRecord] = None
    is_terminal = False


@dataclass
class Running:
    group: WorkerGroup
    is_terminal = False


@dataclass
class Finished:
    is_terminal = True


@dataclass
class Errored:
    error: TrainingFailedError
    is_terminal = True


@dataclass
class Preempting:
    """Beside the state: workers of the running group have been told to leave."""

    workers: set[str]
    deadline: float  # epoch seconds
    boundary: bool = False  # the ranks have learned of it at a report()
