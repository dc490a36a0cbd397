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
    assert result.metrics["world"] == n and result.metrics["device"].startswith("cuda")
    assert result.metrics["cvd"] == "0"  # rank 0 runs on the worker of GPU 0


def test_demo_resumes_after_a_rank_failure_on_gpu(tmp_path):
    from tests.conftest import StorageTarget
    from tests.helpers import demo_config, fault, train_demo

    n = min(2, torch.cuda.device_count())
    storage = StorageTarget("local", str(tmp_path / "runs"))
    config = demo_config([fault(tmp_path, n - 1, 7)])
    result = train_demo(storage, "gpu-demo", config, max_failures=1, workers=n, use_gpu=True)
    assert result.status == "finished"
    assert [f.kind for f in result.failures] == ["exception"]
    assert result.metrics["resumed_from"] == 5
