"""Controller states. Each is a small class carrying its data; two are terminal.

    Restarting ──start──▶ Running ──every rank returned──▶ Draining ──last reports──▶ Finished
        ▲                 │  ▲ │
        │   (a checkpoint │  │ └─notice─▶ Preempting ──JIT checkpoint, or deadline──┐
        │  with workers   ▼  │                                                      │
        │  to spare)   Resizing ──ranks left at the agreed report──▶ (Restarting)   │
        ├──RETRY──── a rank failed: stop the group, record, ask the failure policy ◀┘
        └──RAISE──▶ Errored

Running, Resizing, Preempting and Draining share the running group's `Attempt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FtTrainError, RankFailure
from ..storage.run_state import FailureRecord
from .ports import Group
from .rounds import ReportRounds


@dataclass(frozen=True)
class Suspect:
    """A rank that failed because it lost a peer, judged at `deadline` unless the cause shows."""

    rank: int
    failure: RankFailure
    deadline: float  # the controller's clock's monotonic()


@dataclass
class Attempt:
    """One group's life: its ranks, their rounds, which returned, when each was last heard."""

    group: Group
    rounds: ReportRounds
    done: dict[int, dict] = field(default_factory=dict)  # rank -> its task's summary
    # rank -> last heard (monotonic), in the order heard: `heard` moves a rank to the end
    progress: dict[int, float] = field(default_factory=dict)
    suspect: Suspect | None = None

    def heard(self, rank: int, at: float) -> None:
        """A message from `rank` at `at` (the controller's monotonic clock). Re-inserted, so
        that the running rank heard from least recently is the first of `progress` not `done`:
        the watchdog finds it without a look at every rank at every event (which cost a
        1 024-rank driver ~0.1 s of CPU a round)."""
        self.progress.pop(rank, None)
        self.progress[rank] = at

    def least_recently_heard(self) -> float | None:
        """When the running rank heard from least recently was last heard; None if none runs."""
        return next((t for r, t in self.progress.items() if r not in self.done), None)


@dataclass
class Restarting:
    """No group runs; the next step starts one from the latest committed checkpoint.
    `failure`: what ended the last group (None at the start, and after a resize)."""

    failure: FailureRecord | None = None
    is_terminal = False


@dataclass
class Running:
    attempt: Attempt
    is_terminal = False


@dataclass
class Resizing:
    """The ranks were asked to leave at a later report (all at the same one), to grow."""

    attempt: Attempt
    is_terminal = False


@dataclass
class Preempting:
    """Workers of the group were told to leave by `deadline` (epoch seconds); `boundary`: the
    ranks have learned it at a report, and save a just-in-time checkpoint."""

    attempt: Attempt
    workers: set[str]
    deadline: float
    boundary: bool = False
    is_terminal = False


@dataclass
class Draining:
    """Every rank returned: waiting (until `deadline`, on the clock's monotonic()) for its last `expected`
    reports still in flight."""

    attempt: Attempt
    expected: int
    deadline: float
    is_terminal = False


@dataclass
class Finished:
    is_terminal = True


@dataclass
class Errored:
    error: FtTrainError
    is_terminal = True


GroupState = Running | Resizing | Preempting
State = Restarting | Running | Resizing | Preempting | Draining | Finished | Errored
