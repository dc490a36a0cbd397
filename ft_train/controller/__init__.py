"""The driver-side controller: a state machine over worker-group attempts."""

from .controller import Controller, Segment
from .state import Errored, Finished, Idle, Running

__all__ = ["Controller", "Segment", "Idle", "Running", "Finished", "Errored"]
