"""The process of Prefect's temporary server (`flows.ephemeral`): uvicorn's command line, and a
watch that stops the server once the process that started it is gone.

That process stops its server at exit. A process killed outright (SIGKILL, the OOM killer) runs
nothing at exit, and its server went on serving nobody, with its memory and a few percent of a
core, until the machine restarted; the rerun that resumes the run shared the cores with it. The
starting process holds the write end of this process's stdin, a pipe; Python opens it
close-on-exec, so the other processes it starts (the fork server, Dask's workers) get no copy. The
kernel closes it when that process ends, however it ends, and stdin then reads to its end. Run by
its path, so it imports uvicorn alone.
"""

import os
import signal
import threading

import uvicorn.main

GRACE_S = 10.0  # for uvicorn's own stop (Prefect's services); then the process exits regardless


def _stop_when_orphaned() -> None:
    # Ends at end of file: the process that started this one is gone. The file descriptor, not
    # sys.stdin, whose lock a daemon thread would hold while the interpreter exits (an abort).
    while os.read(0, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(GRACE_S)
    os._exit(1)


if __name__ == "__main__":
    threading.Thread(target=_stop_when_orphaned, name="stop-when-orphaned", daemon=True).start()
    uvicorn.main.main(prog_name="uvicorn")
