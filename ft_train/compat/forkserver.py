"""CPython's multiprocessing fork server, beyond its public API.

ft-train's local CPU workers fork from a server that imported torch once (`driver/cluster.py`),
and a nanny preload does the same on users' clusters (`worker/forkserver.py`). Both must know
whether the server runs already and which modules it imports: the public API can set the preload
list (`set_forkserver_preload`) and start the server (`ensure_running`), but not read either.
CPython keeps them on the module's one `ForkServer` object, `multiprocessing.forkserver._forkserver`,
as `_forkserver_pid` (None until started) and `_preload_modules` (the list last set). Checked on
CPython 3.11 to 3.14; `requires-python` is bounded above accordingly.
"""

from __future__ import annotations

from multiprocessing import forkserver

# What tests/unit/test_private_apis.py checks: (object path, attribute).
PRIVATE_NAMES = (
    ("multiprocessing.forkserver", "_forkserver"),
    ("multiprocessing.forkserver._forkserver", "_forkserver_pid"),
    ("multiprocessing.forkserver._forkserver", "_preload_modules"),
)


def the_server() -> forkserver.ForkServer:
    """The process's one fork server object (started or not): `ensure_running()`,
    `set_forkserver_preload()` are public methods of it."""
    return forkserver._forkserver


def is_running() -> bool:
    """A fork server has been started in this process (by ft-train or anyone else)."""
    return getattr(the_server(), "_forkserver_pid", None) is not None


def preload_modules() -> list[str]:
    """The modules the fork server imports (or will, once started), as last set."""
    return list(getattr(the_server(), "_preload_modules", None) or [])
