"""GPU path: one worker per GPU with CUDA_VISIBLE_DEVICES set, NCCL between ranks.

Skipped without CUDA (CI has no GPU); run on a GPU machine with `pytest tests/test_gpu.py`.
"""

import pytest
import torch

import ft_train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("prefect_api"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_one_worker_per_gpu_with_nccl(tmp_path):
    from flows.train import train

    n = min(2, torch.cuda.device_count())
    result = train(
        train_loop="tests.loops:gpu_probe",
        scaling_config=ft_train.ScalingConfig(num_workers=n, use_gpu=True),
        run_config=ft_train.RunConfig(name="gpu-probe", storage_path=str(tmp_path)),
    )
    # gpu_probe raises on any rank that does not see exactly one GPU through
    # CUDA_VISIBLE_DEVICES with an NCCL process group; max_failures=0 turns that into a failure.
    assert result.status == "finished"
    assert result.last_metrics["world"] == n and result.last_metrics["device"].startswith("cuda")
    assert result.last_metrics["cvd"] == "0"  # rank 0 runs on the worker of GPU 0


def test_demo_resumes_after_a_rank_failure_on_gpu(tmp_path):
    from tests.conftest import StorageTarget
    from tests.helpers import demo_config, fault, train_demo

    n = min(2, torch.cuda.device_count())
    storage = StorageTarget("local", str(tmp_path / "runs"))
    config = demo_config([fault(tmp_path, n - 1, 7)])
    result = train_demo(storage, "gpu-demo", config, max_failures=1, workers=n, use_gpu=True)
    assert result.status == "finished"
    assert [f.kind for f in result.failures] == ["exception"]
    assert result.last_metrics["resumed_from"] == 5


# -- each rank on its own GPU, whatever the cluster shows its workers --------------------------


def device_probe(config):
    """Every rank's GPU (its UUID), its worker's CUDA_VISIBLE_DEVICES and the device index it
    got, gathered to rank 0 over NCCL."""
    import os

    import torch.distributed as dist

    device = ft_train.torch.get_device()
    mine = {
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "index": device.index,
        "local_rank": ft_train.get_context().get_local_rank(),
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ft_train.report({"ranks": everyone})


def gpu_ranks(tmp_path, name, cluster=None) -> list[dict]:
    from flows.train import train

    n = min(2, torch.cuda.device_count())
    result = train(
        train_loop=device_probe,
        scaling_config=ft_train.ScalingConfig(num_workers=n, use_gpu=True),
        run_config=ft_train.RunConfig(name=name, storage_path=str(tmp_path)),
        cluster=cluster or ft_train.ClusterConfig(),
    )
    assert result.status == "finished", result.error
    ranks = result.last_metrics["ranks"]
    assert len({r["uuid"] for r in ranks}) == len(ranks) == n, ranks  # a GPU each
    return ranks


def test_the_local_gpu_cluster_gives_each_rank_its_workers_gpu(tmp_path):
    """The default local GPU cluster (LocalCUDACluster where dask-cuda is installed, else one
    nanny per GPU): each rank on device 0, its worker's own."""
    ranks = gpu_ranks(tmp_path, "gpu-local")
    assert all(r["index"] == 0 and r["cvd"] for r in ranks), ranks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_workers_that_see_every_gpu_share_them_by_local_rank(tmp_path):
    """Workers without CUDA_VISIBLE_DEVICES (torchrun's layout): cuda:LOCAL_RANK."""
    cluster = ft_train.ClusterConfig(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={
            "n_workers": 2,
            "threads_per_worker": 1,
            "host": "127.0.0.1",
            "dashboard_address": None,
            "resources": {"GPU": 1},
        },
    )
    ranks = gpu_ranks(tmp_path, "gpu-shared", cluster)
    assert all(r["index"] == r["local_rank"] and r["cvd"] is None for r in ranks), ranks


@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or __import__("importlib").util.find_spec("dask_cuda") is None,
    reason="needs 2 GPUs and dask-cuda",
)
def test_a_live_local_cuda_cluster_gives_each_rank_its_workers_gpu(tmp_path):
    """dask-cuda rotates CUDA_VISIBLE_DEVICES: set_device(local_rank) put ranks on one GPU."""
    from dask_cuda import LocalCUDACluster

    with LocalCUDACluster(n_workers=2, host="127.0.0.1", resources={"GPU": 1}) as live:
        ranks = gpu_ranks(tmp_path, "gpu-cuda-cluster", ft_train.ClusterConfig(cluster=live))
    assert all(r["index"] == 0 and "," in r["cvd"] for r in ranks), ranks


def test_fsdp_with_sharded_checkpoints_on_gpu(tmp_path):
    """The DCP recipe over NCCL: a failure after a sharded checkpoint, a bit-exact restore."""
    from flows.train import train
    from tests.helpers import fault

    n = min(2, torch.cuda.device_count())
    config = {"steps": 8, "every": 3, "faults": [fault(tmp_path, n - 1, 4)]}
    result = train(
        train_loop="tests.loops:fsdp_dcp",
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=n, use_gpu=True),
        run_config=ft_train.RunConfig(
            name="gpu-fsdp",
            storage_path=str(tmp_path / "runs"),
            failure_config=ft_train.FailureConfig(max_failures=1),
        ),
    )
    assert result.status == "finished", result.error
    assert result.last_metrics["restored_exact"] is True
