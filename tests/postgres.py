"""Prefect on PostgreSQL, for the tests: a PostgreSQL server of the test's own (a temporary data
directory, a free port on loopback), and `prefect server start` on it, as production runs it
(started by tests/prefect_e2e.py, as every server of the tests).

PostgreSQL refuses to run as root: as root, the server runs as the `postgres` user that Debian's
package creates. `unavailable()` says why it cannot run here (not installed: `.ci/run` installs
Debian's `postgresql` package).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ft_train.worker.rank import free_port
from tests import prefect_e2e

USER, PASSWORD, DATABASE = "prefect", "prefect-test-password", "prefect"


def _bin(name: str) -> str | None:
    """A PostgreSQL server program: on PATH, or where Debian's package puts it (its newest)."""
    found = shutil.which(name)
    if found is None:
        versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version)
        found = versions[-1] if versions else None
    return found


def _program(name: str) -> str:
    found = _bin(name)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return found


def _version(path: str) -> tuple[int, ...]:
    return tuple(int(p) for p in Path(path).parts[-3].split(".") if p.isdigit())


def _run_as() -> str | None:
    """The user the server runs as: `postgres` when we are root, else ourselves (None)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "(none)"
    return "postgres"


def unavailable() -> str | None:
    if _bin("initdb") is None or _bin("postgres") is None:
        return "PostgreSQL is not installed (apt-get install postgresql)"
    if _run_as() == "(none)":
        return "running as root, and there is no `postgres` user to run PostgreSQL as"
    return None


def _wait(ready, timeout_s: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
            state = f"exited {proc.returncode}" if proc.poll() is not None else "timed out"
            raise RuntimeError(f"{what} {state}; its log ends:\n{tail}")
        time.sleep(0.2)  # polling a server's readiness, bounded by the deadline


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def postgres_server(workdir: Path) -> Iterator[str]:
    """A PostgreSQL server with a `prefect` database; yields its SQLAlchemy URL (asyncpg).
    Its data directory is under /tmp, which the `postgres` user can reach (a test's tmp_path
    is root's alone); its log goes to `workdir`."""
    user = _run_as()
    base = Path(tempfile.mkdtemp(prefix="ft-train-pg-"))
    data, pwfile = base / "data", base / "pwfile"
    pwfile.write_text(PASSWORD)
    if user is not None:
        pw = pwd.getpwnam(user)
        for path in (base, pwfile):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    try:
        initdb = [_program("initdb"), "-D", str(data), "-U", USER, "--pwfile", str(pwfile)]
        initdb += ["--auth-host=scram-sha-256", "--auth-local=peer", "-E", "UTF8", "--locale=C"]
        done = subprocess.run(initdb, capture_output=True, text=True, user=user)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        port, log = free_port(), workdir / "postgres.log"
        server = [_program("postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port)]
        server += ["-k", str(base)]  # its Unix socket here, not in /var/run/postgresql
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                server, stdout=out, stderr=subprocess.STDOUT, user=user, start_new_session=True
            )
        try:
            ready = [_program("pg_isready"), "-h", "127.0.0.1", "-p", str(port)]
            _wait(lambda: subprocess.run(ready, capture_output=True).returncode == 0, 60,
                  "PostgreSQL", proc, log)  # fmt: skip
            createdb = [_program("createdb"), "-h", "127.0.0.1", "-p", str(port)]
            subprocess.run(
                [*createdb, "-U", USER, DATABASE],
                env=dict(os.environ, PGPASSWORD=PASSWORD),
                check=True,
                capture_output=True,
            )
            yield f"postgresql+asyncpg://{USER}:{PASSWORD}@127.0.0.1:{port}/{DATABASE}"
        finally:
            _stop(proc, signal.SIGINT)  # its fast shutdown
    finally:
        shutil.rmtree(base, ignore_errors=True)


def prefect_server(database_url: str, workdir: Path) -> contextlib.AbstractContextManager[str]:
    """`prefect server start` on `database_url` (tests/prefect_e2e.py starts it), with a Prefect
    home of its own (no SQLite database is made); yields its API URL once it answers."""
    return prefect_e2e.server(workdir, database_url)


def stored_flow_run(database_url: str, flow_run_id: str) -> tuple[str, str] | None:
    """(name, state type) of a flow run as the server's PostgreSQL database holds it."""
    import asyncpg

    async def read() -> tuple[str, str] | None:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            row = await conn.fetchrow(
                "SELECT name, state_type FROM flow_run WHERE id = $1", uuid.UUID(flow_run_id)
            )
        finally:
            await conn.close()
        return None if row is None else (row["name"], str(row["state_type"]))

    return asyncio.run(read())
