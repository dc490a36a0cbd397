"""The quick lane's own guard (`tests/unit/conftest.py`) is in force."""

import socket
import subprocess
import sys

import pytest

from tests.unit.conftest import NotInTheQuickLane


def test_a_subprocess_or_a_socket_fails_a_quick_test():
    with pytest.raises(NotInTheQuickLane, match="move it to tests/"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(NotInTheQuickLane, match="socket"):
        socket.create_connection(("127.0.0.1", 9))
