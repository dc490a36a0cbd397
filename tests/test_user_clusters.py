"""Clusters the user gives, in prefect-dask's conventions: a cluster class with its kwargs (and TLS
through client_kwargs), a live cluster object, a running scheduler's bare host:port; each trains
the demo. Ranks carry torchrun's variables. Bad combinations fail before anything starts.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from distributed import LocalCluster

import ft_train
from ft_train.config import parse
from ft_train.driver import cluster as local
from ft_train.errors import ConfigError
from tests.conftest import StorageTarget
from tests.helpers import demo_config, train_demo

pytestmark = pytest.mark.usefixtures("prefect_api")

# A LocalCluster as a cluster class: worker processes under nannies, one thread each, loopback.
LOCAL_KWARGS = {
    "n_workers": 2,
    "threads_per_worker": 1,
    "processes": True,
    "host": "127.0.0.1",
    "dashboard_address": None,
}


def trains_the_demo(tmp_path, name: str, cluster) -> ft_train.TrainResult:
    storage = StorageTarget("local", str(tmp_path / "runs"))
    result = train_demo(storage, name, demo_config(), cluster=cluster)
    assert result.status == "finished", result.error
    assert result.last_metrics["step"] == 12 and not result.failures, result
    return result


@pytest.fixture(autouse=True, scope="module")
def forked_workers():
    """The clusters here fork their workers from ft-train's fork server, which imported torch
    and the demo's modules once (as ft-train's own local cluster does), instead of spawning
    each: seconds of CPU a worker on this machine."""
    import dask

    from deployments.demo import CLUSTER

    local.start_forkserver(CLUSTER["preload"])
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        yield


# -- validation: one way to the cluster, named fields, before anything starts ------------------


@pytest.mark.parametrize(
    "given, words",
    [
        (
            {"address": "tcp://a:1", "cluster_class": "distributed.LocalCluster"},
            ["cluster.address and cluster.cluster_class are both set", "give one way"],
        ),
        ({"cluster_kwargs": {"n_workers": 2}}, ["cluster.cluster_kwargs is set without"]),
        ({"address": "tcp://a:1", "adapt_kwargs": {"maximum": 2}}, ["cluster.adapt_kwargs"]),
        (
            {"cluster_class": "distributed.LocalCluster", "n_workers": 2},
            ["cluster.n_workers", "cluster_kwargs"],
        ),
        (
            {"cluster_class": "distributed.LocalCluster", "cluster_kwargs": {"asynchronous": 1}},
            ["cluster.cluster_kwargs: 'asynchronous' is not allowed"],
        ),
        ({"cluster": 3}, ["cluster.cluster: int is not a distributed cluster"]),
        ({"address": "host"}, ["cluster.address 'host'", "host:port"]),
    ],
)
def test_bad_combinations_are_refused_naming_the_fields(given, words):
    with pytest.raises(ConfigError) as err:
        parse(ft_train.ClusterConfig, given, "cluster")
    for word in words:
        assert word in str(err.value), err.value


@pytest.mark.parametrize(
    "path, words",
    [
        ("no_such_pkg_ft.SLURMCluster", ["cannot be imported", "ModuleNotFoundError", "install"]),
        ("distributed.NoSuchCluster", ["cannot be imported", "AttributeError"]),
        ("distributed.__version__", ["is a str, not a cluster class"]),
        ("LocalCluster", ["not an import path"]),
    ],
)
def test_a_cluster_class_that_does_not_import_fails_before_the_run(tmp_path, path, words):
    from flows.train import train

    with pytest.raises(ConfigError) as err:
        train(
            train_loop="ft_train.examples.digits:train_loop",
            run_config=ft_train.RunConfig(name="bad-class", storage_path=str(tmp_path)),
            cluster=ft_train.ClusterConfig(cluster_class=path),
        )
    assert f"cluster.cluster_class {path!r}" in str(err.value)
    for word in words:
        assert word in str(err.value), err.value
    assert not (tmp_path / "bad-class").exists()  # nothing written


def test_cluster_kwargs_that_do_not_fit_the_class_are_named():
    cfg = ft_train.ClusterConfig(cluster_class="distributed.SpecCluster", cluster_kwargs={"x": 1})
    with pytest.raises(ConfigError) as err:
        local.check_fits(cfg, ft_train.ScalingConfig())
    assert "cluster.cluster_kwargs do not fit distributed.SpecCluster(" in str(err.value)
    assert "unexpected keyword argument 'x'" in str(err.value), err.value


def test_a_class_given_in_a_python_call_becomes_its_import_path():
    cfg = ft_train.ClusterConfig(cluster_class=LocalCluster, cluster_kwargs=LOCAL_KWARGS)
    assert cfg.cluster_class == "distributed.deploy.local.LocalCluster"
    assert json.loads(cfg.model_dump_json())["cluster_class"] == cfg.cluster_class


@pytest.mark.parametrize(
    "given, url",
    [("127.0.0.1:8786", "tcp://127.0.0.1:8786"), ("[::1]:8786", "tcp://[::1]:8786")],
)
def test_a_bare_host_port_is_a_tcp_address(given, url):
    assert ft_train.ClusterConfig(address=given).address == url


def test_a_live_cluster_cannot_travel_as_a_deployment_parameter():
    """Stored as text (never the object); read back, as a deployment run would, it is refused
    with the way out."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as live:
        stored = json.loads(ft_train.ClusterConfig(cluster=live).model_dump_json())
    assert stored["cluster"] == "<live LocalCluster: Python calls only>"
    with pytest.raises(ConfigError) as err:
        parse(ft_train.ClusterConfig, stored, "cluster")
    for word in ("only in a Python call", "deployment", "cluster.address", "cluster_class"):
        assert word in str(err.value), err.value


# -- the ways to a cluster, each training the demo ---------------------------------------------


def scheduler_settings(dask_scheduler) -> dict:
    return {
        "allowed_failures": dask_scheduler.allowed_failures,
        "address": dask_scheduler.address,
    }


def test_a_cluster_class_gets_ft_trains_scheduler_settings_and_is_closed():
    cfg = ft_train.ClusterConfig(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs=LOCAL_KWARGS,
        adapt_kwargs={"minimum": 3, "maximum": 3},
    )
    with local.dask_client(cfg, ft_train.ScalingConfig(num_workers=2)) as client:
        client.wait_for_workers(3, timeout=120)  # adapt_kwargs took effect
        settings = client.run_on_scheduler(scheduler_settings)
        daemon = client.run(lambda: __import__("dask").config.get("distributed.worker.daemon"))
        made = client.cluster
    assert settings["allowed_failures"] == 0  # Dask's default is 3
    assert set(daemon.values()) == {False}  # a rank may start DataLoader processes
    assert made.status.name == "closed"  # ft-train started it: ft-train closed it


def test_a_cluster_class_with_kwargs_trains_the_demo(tmp_path):
    trains_the_demo(
        tmp_path,
        "class",
        ft_train.ClusterConfig(
            cluster_class="distributed.LocalCluster", cluster_kwargs=LOCAL_KWARGS
        ),
    )


@pytest.mark.skipif(
    importlib.util.find_spec("cryptography") is None, reason="Security.temporary needs cryptography"
)
def test_tls_through_client_kwargs_trains_the_demo_and_stores_no_key(tmp_path):
    from distributed import Security
    from prefect.client.orchestration import get_client

    security = Security.temporary()
    cfg = ft_train.ClusterConfig(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={**LOCAL_KWARGS, "security": security, "protocol": "tls://"},
        client_kwargs={"security": security},
    )
    with local.dask_client(cfg, ft_train.ScalingConfig(num_workers=2)) as client:
        assert client.scheduler.address.startswith("tls://")
    trains_the_demo(tmp_path, "tls", cfg)
    with get_client(sync_client=True) as prefect:
        runs = [r for r in prefect.read_flow_runs() if r.name == "tls"]
    assert runs and "PRIVATE KEY" not in json.dumps(runs[0].parameters)
    assert runs[0].parameters["cluster"]["client_kwargs"]["security"] == "<Security: not stored>"


@pytest.fixture(scope="module")
def live():
    with LocalCluster(**LOCAL_KWARGS) as cluster:
        yield cluster


def test_a_live_cluster_object_trains_the_demo_and_is_left_running(tmp_path, live):
    trains_the_demo(tmp_path, "live", live)  # the object itself as the `cluster` parameter
    assert live.status.name == "running" and len(live.scheduler_info["workers"]) == 2


def test_a_bare_host_port_of_a_running_scheduler_trains_the_demo(tmp_path, live, caplog):
    """`live` was started with Dask's defaults, not ft-train's settings: the run says so."""
    host_port = live.scheduler_address.removeprefix("tcp://")
    trains_the_demo(tmp_path, "host-port", ft_train.ClusterConfig(address=host_port))
    warned = [
        r.getMessage() for r in caplog.records if "ft-train's Dask settings" in r.getMessage()
    ]
    assert warned and "distributed.scheduler.allowed-failures" in warned[0], warned
    assert "`ft-train dask-config`" in warned[0]


@pytest.mark.skipif(
    importlib.util.find_spec("dask_jobqueue") is None, reason="dask-jobqueue is not installed"
)
def test_a_slurm_cluster_class_builds_its_job_script_without_slurm(caplog):
    """What can be tried without SLURM: ft-train starts the SLURMCluster (its scheduler runs in
    the driver, under ft-train's settings) and the job script a worker would be submitted with.
    Submitting jobs (scale, adapt) needs sbatch: not tried here."""
    cfg = ft_train.ClusterConfig(cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=SLURM)
    with local.dask_client(cfg, ft_train.ScalingConfig(num_workers=2)) as client:
        script = client.cluster.job_script()
        settings = client.run_on_scheduler(scheduler_settings)
    assert settings["allowed_failures"] == 0  # ft-train's settings
    assert not [r for r in caplog.records if "ft-train's Dask settings" in r.getMessage()]
    for line in (
        "#SBATCH -t 04:00:00",
        "#SBATCH --gres=gpu:1",
        "#SBATCH --cpus-per-task=8",
        'ft-train dask-config > "$DASK_CONFIG"',
        "--nthreads 1",
        "--nanny",
        "--resources GPU=1",
        "--lifetime 230m --lifetime-stagger 4m",
        "--preload-nanny ft_train.worker.forkserver --preload ft_train.driver.cluster",
        settings["address"],
    ):
        assert line in script, script


# The SLURM example of docs/clusters.md, as ft-train is given it.
SLURM = {
    "cores": 1,  # the worker's threads: one, for its rank
    "job_cpu": 8,  # the job's CPUs, for the rank's torch threads and DataLoader processes
    "processes": 1,  # one worker (one rank) per job, with its GPU
    "memory": "64GB",
    "walltime": "04:00:00",
    "job_extra_directives": ["--gres=gpu:1"],
    "job_script_prologue": [  # ft-train's Dask settings for the worker (docs/clusters.md)
        "export DASK_CONFIG=/tmp/ft-train-dask-$SLURM_JOB_ID.yaml",
        'ft-train dask-config > "$DASK_CONFIG"',
    ],
    "worker_extra_args": [
        "--resources",
        "GPU=1",
        "--lifetime",
        "230m",
        "--lifetime-stagger",
        "4m",
        "--preload-nanny",  # torch in the fork server the worker processes start from
        "ft_train.worker.forkserver",
        "--preload",
        "ft_train.driver.cluster",
    ],
    "scheduler_options": {"host": "127.0.0.1", "dashboard_address": None},
}


# -- torchrun's variables, from inside the ranks ------------------------------------------------


def torchrun_probe(config):
    """Every rank's torchrun variables, gathered to rank 0, beside what the group says."""
    import os

    import torch.distributed as dist

    ctx = ft_train.get_context()
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"]
    names += ["MASTER_ADDR", "MASTER_PORT"]
    mine = {n: os.environ.get(n) for n in names}
    mine["truth"] = [dist.get_rank(), ctx.get_local_rank(), dist.get_world_size()]
    mine["truth"] += [ctx.get_local_world_size(), ctx.get_node_rank()]
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStores around the rendezvous' TCPStore
        store = store.underlying_store
    mine["store"] = [store.host, store.port]
    import torch

    ddp = ft_train.torch.prepare_model(
        torch.nn.Linear(2, 2), parallel_strategy_kwargs={"find_unused_parameters": True}
    )
    mine["ddp_kwargs"] = ddp.find_unused_parameters  # passed through to DDP
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ft_train.report({"ranks": everyone})


def test_every_rank_carries_torchruns_variables(tmp_path, live):
    from flows.train import train

    result = train(
        train_loop=torchrun_probe,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(name="torchrun", storage_path=str(tmp_path)),
        cluster=ft_train.ClusterConfig(cluster=live),
    )
    ranks = result.last_metrics["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        rank, local_rank, world, local_world, node = r["truth"]
        assert r["RANK"] == str(rank) and r["WORLD_SIZE"] == str(world) == "2"
        assert r["LOCAL_RANK"] == str(local_rank) and r["LOCAL_WORLD_SIZE"] == str(local_world)
        assert r["NODE_RANK"] == str(node) == "0"
        assert [r["MASTER_ADDR"], int(r["MASTER_PORT"])] == list(r["store"])  # the rendezvous
    assert sorted(int(r["LOCAL_RANK"]) for r in ranks) == [0, 1]
    assert all(r["ddp_kwargs"] is True for r in ranks)
