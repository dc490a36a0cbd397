"""The driver-side controller: a state machine over worker-group attempts."""

from .callbacks import Callback
from .controller import Controller, Segment
from .ports import Cluster, Group, GroupPlan
from .state import Draining, Errored, Finished, Preempting, Resizing, Restarting, Running

__all__ = [
    "Callback",
    "Cluster",
    "Controller",
    "Draining",
    "Errored",
    "Finished",
    "Group",
    "GroupPlan",
    "Preempting",
    "Resizing",
    "Restarting",
    "Running",
    "Segment",
]
