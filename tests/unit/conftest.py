"""The quick lane: tests that need no Prefect API, Dask cluster, subprocess, database or socket,
so that the whole lane runs in well under a minute (`python -m pytest tests/unit`).

A test here that starts a process or opens a network socket fails, naming what it started: such
a test belongs in `tests/` beside the other end-to-end tests."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess

import pytest


class NotInTheQuickLane(RuntimeError):
    pass


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise NotInTheQuickLane(
            f"tests/unit is the quick lane: this test started {what}; move it to tests/"
        )

    return refuse


@pytest.fixture(autouse=True)
def _no_process_or_socket(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.Process, "start", _refuse("a process"))
    for method in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, method, _refuse(f"a socket ({method})"))
