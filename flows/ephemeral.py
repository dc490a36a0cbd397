"""Prefect's temporary API server, started at the moment a Python call of the flow begins.

With no PREFECT_API_URL, Prefect starts a temporary server the first time a flow asks for its
client: it imports the server's code in the calling process (about 5 s on 2 cores), then starts
the server process, which imports the same code again and opens its database (about 7 s). One
after the other, they were most of the call's time to the first step. Here the call starts that
server process at once, with the command and settings Prefect uses (uvicorn serving
`prefect.server.api.server:create_app`, UI off), and runs the flow with PREFECT_API_URL pointing
to it; the calling process never imports the server. It serves this process's later calls too and
stops when the process exits, as Prefect's does, and also when the process is killed, which
Prefect's does not (`flows/ephemeral_server.py`).

Only where Prefect itself would start one: no PREFECT_API_URL, ephemeral mode on, and no flow
or task run around the call (a flow called from another flow reports to its parent's API).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import prefect
from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging import get_logger
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_EPHEMERAL_ENABLED,
    get_current_settings,
    temporary_settings,
)

from . import prefect_private

logger = get_logger()  # "prefect", where Prefect says it starts and stops its temporary server

# How long to wait for the server where PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is not
# set. Prefect's default, 20 s, is too short for a first start on 2 cores: the server imports its
# code, then creates its database (migrations and block types), 19 to 25 s in all here, against
# 9 s once the database exists. Prefect's own start fails the same way at random (its issue
# #16397); a user's first `ft-train demo` must not. The wait ends at once if the process exits.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
STILL_STARTING_S = 15.0  # a wait this long says why it takes so long, once


class TemporaryServer:
    """One `create_app` server process on a loopback port of its own; `wait()` until it is
    healthy."""

    def __init__(self) -> None:
        self.stopping = False
        self.healthy = False
        # Bound here and handed over listening: no other process can take the port before the
        # server serves, and requests sent meanwhile wait in its backlog.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            logger.info(
                f"Starting temporary server on http://127.0.0.1:{self.port}\nSee "
                "https://www.prefect.io/docs/v3/concepts/server#how-to-guides "
                "for more information on running a dedicated Prefect server."
            )
            env = {
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                **prefect_private.EPHEMERAL_SERVER_ENV,
                **get_current_settings().to_environment_variables(exclude_unset=True),
            }
            self.process: subprocess.Popen | None = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("ephemeral_server.py")),
                    str(sock.fileno()),
                    str(Path(prefect.__file__).parents[1]),
                ],
                env=env,
                pass_fds=[sock.fileno()],
                stdin=subprocess.PIPE,  # closed when this process ends: the server then stops too
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        threading.Thread(
            target=self._relay,
            args=(self.process,),
            name="ft-train-prefect-server-output",
            daemon=True,
        ).start()
        atexit.register(self.stop)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _relay(self, process: subprocess.Popen) -> None:
        """Pass the server's output on to this process's stderr, until it is told to stop. What it
        prints while it stops is dropped: Prefect's services, cancelled mid-flush, print tracebacks
        at times (a run that had finished printed five), and a run that failed nothing must
        print none."""
        assert process.stdout is not None
        for line in process.stdout:
            if not self.stopping:
                sys.stderr.write(line.decode(errors="replace"))

    def wait(self, timeout_s: float) -> None:
        """Return once the server answers /health; raise if it exits or `timeout_s` passes."""
        started, told = time.monotonic(), False
        deadline = started + timeout_s
        with httpx.Client(timeout=1.0) as client:  # a request waits in the backlog meanwhile
            while not self.healthy:
                if not told and time.monotonic() - started > STILL_STARTING_S:
                    logger.info(
                        f"The temporary server is still starting (a first start creates its "
                        f"database); waiting up to {timeout_s:.0f}s"
                    )
                    told = True
                assert self.process is not None
                code = self.process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"Prefect's temporary server exited with status {code}; its "
                        "output above says why"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Prefect's temporary server did not answer within {timeout_s:.0f}s; raise "
                        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or set PREFECT_API_URL "
                        "to a running server"
                    )
                with contextlib.suppress(httpx.TransportError):
                    self.healthy = client.get(f"{self.api_url}/health").status_code == 200
                if not self.healthy:
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None:
            return
        logger.info(f"Stopping temporary server on http://127.0.0.1:{self.port}")
        self.stopping = True
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


_server: TemporaryServer | None = None
_lock = threading.Lock()


def start() -> TemporaryServer | None:
    """This process's temporary server, started now if it is not yet; None where Prefect would
    not start one (an API is set, ephemeral mode is off, or a flow or task run is around)."""
    global _server
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
        return None
    with _lock:
        if _server is None or _server.process is None:
            _server = TemporaryServer()
        return _server


def startup_timeout_s() -> float:
    """PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS where it is set (environment, profile or
    temporary settings), else DEFAULT_STARTUP_TIMEOUT_S."""
    settings = get_current_settings().server.ephemeral
    if "startup_timeout_seconds" in settings.model_fields_set:
        return float(settings.startup_timeout_seconds)
    return DEFAULT_STARTUP_TIMEOUT_S


@contextlib.contextmanager
def api(server: TemporaryServer | None) -> Iterator[None]:
    """Within: Prefect's API is `server`, once it answers (unchanged where `server` is None)."""
    if server is None:
        yield
        return
    server.wait(startup_timeout_s())
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield
