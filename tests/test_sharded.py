"""GPUs done right, tested on CPU: which device each rank takes (`pick_device`, a pure function of
what the ranks on a host see), FSDP2 through `prepare_model(parallel_strategy="fsdp2")` on gloo,
and the torch.distributed.checkpoint recipe: every rank saves its shard through `report()`, a
restore after a failure reads them back bit-exactly and training goes on as if uninterrupted.
"""

from __future__ import annotations

import os

import pytest

import ft_train
from ft_train.errors import ConfigError
from ft_train.worker.devices import pick_device
from tests.helpers import fault

# -- the device each rank takes ----------------------------------------------------------------


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


# -- FSDP and sharded checkpoints (DCP) on gloo --------------------------------------------------


def fsdp_dcp(config):
    """An FSDP2 model trained with AdamW, each step's batch drawn from the step number; every
    `every` steps each rank saves its shard with `save_sharded` into its own directory and
    attaches it, with its local shards as plain tensors (`expect-{rank}.pt`) to compare with.
    A restore loads the checkpoint into a model initialised differently and reports whether the
    shards it got equal the saved ones, bit for bit."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ft_train.testing.faults import maybe_inject

    rank = ft_train.get_context().get_world_rank()
    torch.manual_seed(1 if ft_train.get_checkpoint() else 0)  # a restore must not rely on it
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = ft_train.torch.prepare_model(net, parallel_strategy="fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    step, exact = 0, None
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "step": torch.tensor(0)}
        with checkpoint.as_directory() as d:
            ft_train.torch.load_sharded(state, d)
            expect = torch.load(os.path.join(d, f"expect-{rank}.pt"))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        step = int(state["step"])
        exact = local_shards(get_state_dict(model, optimizer)) == {
            k: v.tolist() for k, v in expect.items()
        }
    while step < config["steps"]:
        maybe_inject(config.get("faults"), rank, step)
        batch = torch.Generator().manual_seed(step * 2 + rank)
        x, y = torch.randn(16, 8, generator=batch), torch.randn(16, 4, generator=batch)
        device = ft_train.torch.get_device()  # cuda on a GPU run (tests/test_gpu.py)
        loss = ((model(x.to(device)) - y.to(device)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        metrics = {"step": step, "restored_exact": exact, "params": params(model)}
        if step % config["every"]:
            ft_train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:
            msd, osd = get_state_dict(model, optimizer)
            ft_train.torch.save_sharded({"model": msd, "optim": osd, "step": torch.tensor(step)}, d)
            shards = {k: torch.tensor(v) for k, v in local_shards((msd, osd)).items()}
            torch.save(shards, os.path.join(d, f"expect-{rank}.pt"))
            ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(d))


def local_shards(state_dicts) -> dict:
    """This rank's shard of every tensor in (model, optimizer) state dicts, as lists."""
    from torch.distributed.tensor import DTensor

    out = {}
    msd, osd = state_dicts
    flat = {f"model.{k}": v for k, v in msd.items()}
    for p, s in osd["state"].items():
        flat.update({f"optim.{p}.{k}": v for k, v in s.items()})
    for k, v in flat.items():
        v = v.to_local() if isinstance(v, DTensor) else v
        out[k] = v.detach().cpu().reshape(-1).tolist() if hasattr(v, "detach") else v
    return out


def params(model) -> list:
    """The full parameters (every rank's shards), as exact float lists."""
    return [p.full_tensor().detach().reshape(-1).tolist() for p in model.parameters()]


def test_fsdp_shards_checkpointed_with_dcp_restore_bit_exactly(prefect_api, tmp_path):
    from flows.train import train

    def run(name, faults=(), max_failures=0):
        return train(
            train_loop=fsdp_dcp,
            train_loop_config={"steps": 8, "every": 3, "faults": list(faults)},
            scaling_config=ft_train.ScalingConfig(num_workers=2),
            run_config=ft_train.RunConfig(
                name=name,
                storage_path=str(tmp_path / "runs"),
                failure_config=ft_train.FailureConfig(max_failures=max_failures),
            ),
        )

    whole = run("whole")
    resumed = run("resumed", [fault(tmp_path, 1, 4)], max_failures=1)
    assert whole.status == resumed.status == "finished", (whole.error, resumed.error)
    assert [f.kind for f in resumed.failures] == ["exception"]
    assert resumed.last_metrics["restored_exact"] is True  # each rank's shards, bit for bit
    assert (
        resumed.last_metrics["params"] == whole.last_metrics["params"]
    )  # and it trains on the same
    files = sorted(os.listdir(resumed.checkpoint.path))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files), files
