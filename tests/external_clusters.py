"""External Dask clusters for the tests: a `dask scheduler` and workers on loopback, each a
process of its own, reached by address as an operator's cluster is.

Two kinds, by what a lost worker means:
- `ExternalCluster`: `dask worker` processes without nannies; a killed worker is gone for good
  (the node-failure and preemption-polling tests).
- `NannyCluster`: nodes, each a process group of a nanny (`NANNY`) and its worker; killing the
  worker's process leaves the nanny to start a new one, killing the group takes the node away
  (the chaos and snapshot tests).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import ft_train
from ft_train.worker.rank import free_port
from tests.helpers import DEMO, REPO, wait_for

DASK = str(Path(sys.executable).parent / "dask")

# Nannies fork their worker processes from a server that imported these once: a new worker is
# warm in ~0.2 s instead of ~4 CPU-seconds of imports each (2 cores, 30+ worker starts), and no
# rank spends its hang watchdog's window importing what DDP loads on first use (torch._dynamo)
# or what the demo imports when it loads its data (sklearn.datasets).
WARM_MODULES = ["distributed", "ft_train.examples.digits", "sklearn.datasets", "torch._dynamo"]
FORK_WARM_WORKERS = f"""
import dask
from distributed.utils import get_mp_context
dask.config.set({{"distributed.worker.multiprocessing-method": "forkserver"}})
get_mp_context().set_forkserver_preload({WARM_MODULES!r})
"""
NANNY = (
    FORK_WARM_WORKERS
    + """
import asyncio, sys
from distributed import Nanny

async def main():
    async with Nanny(sys.argv[1], name=sys.argv[2], nthreads=1, host="127.0.0.1") as nanny:
        await nanny.finished()

asyncio.run(main())
"""
)


class _Processes:
    """A scheduler on a free loopback port, and the processes started beside it (each in a
    process group of its own, its output in `tmp_path/<name>.log`)."""

    def __init__(self, tmp_path: Path):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.tmp_path = tmp_path
        self.env = dict(os.environ, PYTHONPATH=REPO, DASK_DISTRIBUTED__WORKER__DAEMON="False")
        self.procs: dict[str, subprocess.Popen] = {}
        port = self.address.rsplit(":", 1)[1]
        self._start(
            "scheduler",
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", port, "--no-dashboard"],
        )

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.tmp_path / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            cmd,
            env=self.env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


class ExternalCluster(_Processes):
    """`dask scheduler` and `dask worker` processes on loopback, as an operator would run them."""

    def add_worker(self, name):
        self._start(
            name,
            [
                DASK,
                "worker",
                self.address,
                "--name",
                name,
                "--nthreads",
                "1",
                "--no-nanny",
                "--no-dashboard",
            ],
        )

    def workers(self) -> dict[str, str]:
        """name -> address of the workers the scheduler knows now."""
        from distributed import Client

        with Client(self.address, timeout=30) as c:
            return {w["name"]: a for a, w in c.scheduler_info(n_workers=-1)["workers"].items()}

    def wait_workers(self, names):
        wait_for(lambda: set(names) <= set(self.workers()), 120, f"workers {names}")

    def kill(self, name, sig=signal.SIGKILL):
        os.killpg(self.procs[name].pid, sig)

    def train(
        self, storage, name, config=None, *, train_loop=DEMO, scaling=None, preload=(), **failure
    ):
        """The ft-train flow on this cluster: the demo on two ranks unless told otherwise;
        `failure` holds FailureConfig's fields."""
        from flows.train import train

        return train(
            train_loop=train_loop,
            train_loop_config=config,
            scaling_config=scaling or ft_train.ScalingConfig(num_workers=2),
            run_config=ft_train.RunConfig(
                name=name,
                storage_path=storage.path,
                storage_options=storage.options,
                failure_config=ft_train.FailureConfig(**failure),
            ),
            cluster=ft_train.ClusterConfig(address=self.address, preload=preload),
        )


class NannyCluster(_Processes):
    """A `dask scheduler` and worker nodes on loopback: each node a process group of a nanny (see
    NANNY) and its worker. Killing a node's process group takes it away for good."""

    def __init__(self, tmp_path: Path):
        super().__init__(tmp_path)
        self.client = None

    def add_node(self, prefix: tuple[str, ...] = ()) -> str:
        """A node; `prefix`: a command that runs it (in a namespace of its own, say)."""
        name = f"w{len(self.procs) - 1}"
        self._start(name, [*prefix, sys.executable, "-c", NANNY, self.address, name])
        return name

    def connect(self) -> None:
        """Wait for the scheduler and every node started so far."""
        from distributed import Client

        names = [n for n in self.procs if n != "scheduler"]
        self.client = Client(self.address, timeout=60, set_as_default=False)
        wait_for(lambda: set(names) <= set(self.workers().values()), 120, f"workers {names}")

    def workers(self) -> dict[str, str]:
        """address -> name of the workers the scheduler knows now."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return {a: str(w["name"]) for a, w in info.items()}

    def running(self, key: str) -> str:
        """The address of the worker that runs the task `key`."""
        return {k: a for a, keys in self.client.processing().items() for k in keys}[key]

    def take_away(self, address: str, replace: bool = True) -> None:
        """Kill the node of the worker at `address`, and start a replacement node."""
        nanny = self.procs[self.workers()[address]]
        # The nanny first, so that it is gone once the scheduler sees its worker go: a lost
        # worker whose nanny still answers is a process death, not a lost node.
        nanny.kill()
        nanny.wait()
        try:
            os.killpg(nanny.pid, signal.SIGKILL)  # the worker (and fork server) left in its group
        except ProcessLookupError:
            pass  # they already left with the nanny
        if replace:
            self.add_node()

    def sigterm(self, address: str) -> None:
        """What a cloud does to a preempted machine's processes: SIGTERM to the worker."""
        pid = self.client.run(os.getpid, workers=[address])[address]
        os.kill(pid, signal.SIGTERM)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        super().close()
