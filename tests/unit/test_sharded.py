"""Which device each rank takes (`pick_device`, a pure function of what the ranks on a host
see); FSDP2 and sharded checkpoints on gloo are in `tests/test_sharded.py`."""

from __future__ import annotations

import pytest

from ft_train.errors import ConfigError
from ft_train.worker.devices import pick_device


def picks(host_devices):
    return [pick_device(i, host_devices) for i in range(len(host_devices))]


def test_a_local_cuda_cluster_rank_uses_its_own_worker_gpu():
    """dask-cuda rotates CUDA_VISIBLE_DEVICES: worker i sees i, i+1, ..., 0, ...: device 0 is its
    own, whatever order the ranks are in (set_device(local_rank) put ranks 1 and 3 of 4 on the
    same GPUs as 3 and 1's... and 2 of 2 ranks on one)."""
    gpus = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    rotated = [gpus[i:] + gpus[:i] for i in range(4)]
    assert picks(rotated) == [0, 0, 0, 0]
    assert picks([rotated[2], rotated[0], rotated[3], rotated[1]]) == [0, 0, 0, 0]
    assert picks(rotated[:2]) == [0, 0]  # two workers of a 4-GPU machine


def test_one_gpu_per_worker_is_device_0():
    assert picks([["GPU-a"], ["GPU-b"]]) == [0, 0]


def test_ranks_that_see_the_same_gpus_take_them_by_local_rank():
    """No CUDA_VISIBLE_DEVICES, or one list for the host (a SLURM job's): torchrun's
    cuda:LOCAL_RANK."""
    assert picks([["GPU-a", "GPU-b", "GPU-c"]] * 3) == [0, 1, 2]


def test_two_jobs_whose_cgroups_each_number_their_gpus_from_0():
    """Two SLURM jobs on one node, two ranks each, each job seeing its own two GPUs as 0, 1."""
    job_a, job_b = ["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"]
    assert picks([job_a, job_a, job_b, job_b]) == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "host, words",
    [
        ([[], []], ["local rank 1 on host 'h1' finds no GPU (it sees [])", "use_gpu=False"]),
        ([["GPU-a"], ["GPU-a"]], ["no GPU that a rank before it did not take", "one worker per"]),
    ],
)
def test_a_rank_without_a_gpu_of_its_own_is_refused(host, words):
    with pytest.raises(ConfigError) as err:
        pick_device(1, host, host="h1")
    for word in words:
        assert word in str(err.value), err.value
