"""Separate hosts on one machine: a Dask scheduler, two worker hosts and the S3 endpoint each in
a network namespace of its own (`tests/netns.py`), the driver (this process) in the root
namespace. Host A runs one worker (rank 0), host B two (rank 1 and a spare), each under a nanny.

Host A is then cut off the network mid-run: no process dies and no connection is closed, so
nothing tells anyone at once. The scheduler drops A's worker when its heartbeats stop
(`worker-ttl`); until then rank 1 waits in a gloo collective for rank 0. The driver charges a
node loss (A's nanny does not answer either), kills rank 1's process (its nanny starts a fresh
one), and the group restarts on host B from the last committed checkpoint, bit-exact against a
fault-free run on the same hosts.

Gloo picks its interface from the host name, which resolves to no address inside a namespace:
the workers are given `GLOO_SOCKET_IFNAME`, as on any host with several networks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from distributed import Client

import ft_train
from deployments.demo import CLUSTER as DEMO_CLUSTER
from ft_train.worker.warm import TORCH
from tests import netns
from tests.conftest import StorageTarget
from tests.helpers import (
    DEMO,
    assert_bit_identical,
    demo_config,
    fault,
    final_weights,
    load_state,
    wait_for,
)

REPO = str(Path(__file__).resolve().parents[1])
DASK = str(Path(sys.executable).parent / "dask")
WORKER_TTL_S = 10  # the scheduler's heartbeat timeout for a worker (`worker-ttl`)

_why_not = netns.unavailable()
pytestmark = [
    pytest.mark.skipif(_why_not is not None, reason=f"separate hosts: {_why_not}"),
    pytest.mark.usefixtures("prefect_api"),
]


class Hosts:
    """The cluster across namespaces, started as an operator would start it on real hosts."""

    def __init__(self, network: netns.Network):
        self.network = network
        self.env = dict(os.environ, PYTHONPATH=REPO)
        sched, s3 = network.add_host("sched"), network.add_host("s3")
        self.a, self.b = network.add_host("a"), network.add_host("b")
        self.address = f"tcp://{sched.address}:8786"
        # What ft-train needs of a scheduler it did not start (docs/prefect.md, "Production set-up").
        scheduler_env = {
            **self.env,
            "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0",
            "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": f"{WORKER_TTL_S}s",
        }
        cmd = [DASK, "scheduler", "--host", sched.address, "--port", "8786", "--no-dashboard"]
        sched.start("scheduler", cmd, scheduler_env, REPO)
        cmd = [sys.executable, "-m", "moto.server", "-H", s3.address, "-p", "5000"]
        s3.start("s3", cmd, self.env, REPO)
        self.s3_endpoint = f"http://{s3.address}:5000"
        for host, name in ((self.a, "a0"), (self.b, "b0"), (self.b, "b1")):
            self.add_worker(host, name)

    def add_worker(self, host: netns.Host, name: str) -> None:
        env = {
            **self.env,
            "GLOO_SOCKET_IFNAME": netns.IFNAME,
            "DASK_DISTRIBUTED__WORKER__DAEMON": "False",  # a rank may start processes
        }
        cmd = [DASK, "worker", self.address, "--host", host.address, "--name", name]
        cmd += ["--nthreads", "1", "--no-dashboard"]
        # What a rank imports, imported before the worker joins. Imported later (ft-train's
        # warm imports run on the worker's event loop), they would hold its heartbeats for
        # longer than this worker-ttl on a loaded machine, and the scheduler would drop it.
        for module in (*TORCH, *DEMO_CLUSTER["preload"]):
            cmd += ["--preload", module]
        host.start(name, cmd, env, REPO)

    def workers(self) -> dict[str, str]:
        """name -> address of the workers the scheduler knows now."""
        with Client(self.address, timeout=30) as c:
            return {w["name"]: a for a, w in c.scheduler_info(n_workers=-1)["workers"].items()}

    def tasks_run(self) -> dict[str, int]:
        """name -> tasks each worker has run (a rank is one task)."""
        with Client(self.address, timeout=30) as c:
            names = {a: w["name"] for a, w in c.scheduler_info(n_workers=-1)["workers"].items()}
            counts = c.run(lambda dask_worker: dask_worker.state.executed_count)
        return {names[a]: n for a, n in counts.items()}

    def storage(self) -> StorageTarget:
        import s3fs

        options = {"endpoint_url": self.s3_endpoint, "key": "testing", "secret": "testing"}
        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("runs")
        return StorageTarget("s3", "s3://runs", options)

    def train(self, storage: StorageTarget, name: str, config: dict, **failure):
        from flows.train import train

        return train(
            train_loop=DEMO,
            train_loop_config=config,
            scaling_config=ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=120),
            run_config=ft_train.RunConfig(
                name=name,
                storage_path=storage.path,
                storage_options=storage.options,
                failure_config=ft_train.FailureConfig(**failure),
            ),
            cluster=ft_train.ClusterConfig(address=self.address),
        )


@pytest.fixture
def hosts(tmp_path):
    network = netns.Network(tmp_path)
    try:
        h = Hosts(network)
        wait_for(lambda: _answers(h.s3_endpoint), 60, "the S3 endpoint in its namespace")
        wait_for(lambda: {"a0", "b0", "b1"} <= set(h.workers()), 120, "workers a0, b0, b1")
        yield h
    finally:
        network.close()  # every process, namespace and link, whatever the test left


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(300)
def test_a_host_cut_off_the_network_is_lost_within_worker_ttl_and_the_run_recovers(tmp_path, hosts):
    storage = hosts.storage()
    reference = hosts.train(storage, "reference", demo_config())
    assert reference.status == "finished" and not reference.failures
    # the ranks ran on both hosts: rank 0 on a0 (host A), rank 1 on b0 (host B)
    assert hosts.tasks_run() == {"a0": 1, "b0": 1, "b1": 0}

    # Rank 0 holds at step 7, after the checkpoint of step 5, so the cut comes mid-run.
    hold = fault(tmp_path, 0, 7, kind="wait")
    cut = {}

    def cut_host_a():
        wait_for(lambda: os.path.exists(hold["marker"]), 120, "rank 0 to reach step 7")
        cut["at"] = time.time()
        hosts.a.cut()

    threading.Thread(target=cut_host_a, daemon=True).start()
    result = hosts.train(storage, "cut", demo_config([hold]), max_failures=1)

    assert result.status == "finished" and result.last_metrics["resumed_from"] == 5
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("node_loss", 0)
    # Only the heartbeats tell: the scheduler checks them every worker-ttl, so a worker silent
    # since the cut is dropped between one and two worker-ttl after it (less the heartbeat
    # interval, 0.5 s, that its last heartbeat may precede the cut by).
    detected_s = failure.time.timestamp() - cut["at"]
    print(f"host A cut off: the loss was seen after {detected_s:.1f}s (worker-ttl {WORKER_TTL_S}s)")
    assert WORKER_TTL_S - 1 <= detected_s <= 2 * WORKER_TTL_S + 5, detected_s
    state = load_state(storage, "cut")
    assert [a.world_size for a in state.attempts] == [2, 2]
    assert state.attempts[1].restored_from.startswith("checkpoint_000005-a0-")
    # the new group ran on host B alone: b1, and b0's fresh process (its nanny's). The scheduler
    # forgets a0 only once its restart of a0 (through a0's nanny, unreachable) times out: 30 s.
    wait_for(lambda: "a0" not in hosts.workers(), 60, "the scheduler to drop a0")
    workers = hosts.workers()
    assert set(workers) == {"b0", "b1"}
    assert all(addr.startswith(f"tcp://{hosts.b.address}:") for addr in workers.values())
    assert_bit_identical(final_weights(result), final_weights(reference))
