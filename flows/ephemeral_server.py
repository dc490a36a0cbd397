"""The process of Prefect's temporary server (`flows.ephemeral`): uvicorn serving Prefect's app
on a listening socket it is handed, and a watch that stops the server once the process that
started it is gone.

The socket: the starting process binds a free loopback port and passes the listening socket on
(file descriptor `argv[1]`), so the port cannot be taken by another process between the choice
and the bind, and a request sent while the server still starts waits in the socket's backlog and
is answered as soon as it serves.

The watch: that process stops its server at exit. A process killed outright (SIGKILL, the OOM
killer) runs nothing at exit, and its server went on serving nobody, with its memory and a few
percent of a core, until the machine restarted; the rerun that resumes the run shared the cores
with it. The starting process holds the write end of this process's stdin, a pipe; Python opens it
close-on-exec, so the other processes it starts (the fork server, Dask's workers) get no copy. The
kernel closes it when that process ends, however it ends, and stdin then reads to its end. Run by
its path, so it imports uvicorn alone.

    python ephemeral_server.py FD APP_DIR
"""

import os
import signal
import socket
import sys
import threading

import uvicorn

# run as a script: its own directory, flows/, is first on sys.path
from prefect_private import SERVER_APP  # flows/prefect_private.py
from uvicorn.main import STARTUP_FAILURE

GRACE_S = 10.0  # for uvicorn's own stop (Prefect's services); then the process exits regardless


def _stop_when_orphaned() -> None:
    # Ends at end of file: the process that started this one is gone. The file descriptor, not
    # sys.stdin, whose lock a daemon thread would hold while the interpreter exits (an abort).
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(GRACE_S)
    os._exit(1)


def main(fd: int, app_dir: str) -> None:
    # Family and type read from the socket itself: uvicorn's own --fd takes any socket for a Unix
    # one, and asyncio then leaves Nagle's algorithm on for every connection.
    sock = socket.socket(fileno=fd)
    threading.Thread(target=_stop_when_orphaned, name="stop-when-orphaned", daemon=True).start()
    # What Prefect's own server command runs: its app factory, from its package's directory (the
    # starting process turns the UI off), errors only.
    sys.path.insert(0, app_dir)
    config = uvicorn.Config(SERVER_APP, factory=True, log_level="error", lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl+C reaches the starting process's whole group
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)  # the app failed to start


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
