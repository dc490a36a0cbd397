"""Ray's getting-started loop on the flow, with `ft_train` names: a shuffled DataLoader through
`prepare_data_loader`, `train_loader.sampler.set_epoch(epoch)` at each epoch, a checkpoint per
epoch (model, optimizer, epoch). A rank raises in epoch 2; the restarted run must train on the
same batches as an uninterrupted one, so the final weights are the same bits.

The loop runs at a few ms a step (a tiny model); `tests/test_ray_compat.py` runs the pattern
matrix at realistic step times.
"""

from __future__ import annotations

import os
import tempfile

import torch

import ft_train
import ft_train.torch
from tests.conftest import on_storage
from tests.helpers import assert_bit_identical, fault, run_config

EPOCHS, SAMPLES, BATCH = 4, 64, 8  # 4 batches a rank an epoch


def getting_started(config):
    """Ray's getting-started training function after the rename. Rank 0 saves; each epoch's
    first batch (its sample indices) goes into the checkpoint, so that a test can see the order
    of every epoch the final weights came from."""
    from torch.utils.data import DataLoader, TensorDataset

    from ft_train.testing.faults import maybe_inject

    ctx = ft_train.get_context()
    rank = ctx.get_world_rank()
    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.arange(SAMPLES),
        torch.randn(SAMPLES, 8, generator=data),
        torch.randn(SAMPLES, 4, generator=data),
    )
    train_loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    train_loader = ft_train.torch.prepare_data_loader(train_loader)
    torch.manual_seed(0)
    model = ft_train.torch.prepare_model(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start, first_batches = 0, []
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "checkpoint.pt"))
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, first_batches = state["epoch"] + 1, state["first_batches"]

    for epoch in range(start, EPOCHS):
        if ctx.get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)  # the step a restart must not lose
        for i, (index, x, y) in enumerate(train_loader):
            if i == 0:
                first_batches.append(index.tolist())
            maybe_inject(config.get("faults"), rank, epoch * len(train_loader) + i)
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            saved = None
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "first_batches": first_batches,
                }
                torch.save(state, os.path.join(d, "checkpoint.pt"))
                saved = ft_train.Checkpoint.from_directory(d)
            ft_train.report({"epoch": epoch, "loss": loss.item()}, checkpoint=saved)


def train(storage, name, faults=(), max_failures=0) -> ft_train.TrainResult:
    from flows.train import train

    return train(
        train_loop="tests.test_data_loader:getting_started",
        train_loop_config={"faults": list(faults)},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(storage, name, max_failures),
    )


def saved_state(result: ft_train.TrainResult) -> dict:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "checkpoint.pt"))


@on_storage("local")
def test_a_restart_in_epoch_2_trains_on_the_batches_of_an_uninterrupted_run(
    prefect_api, storage, tmp_path
):
    whole = train(storage, "whole")
    step_in_epoch_2 = 2 * (SAMPLES // 2 // BATCH) + 1  # rank 1's second batch of epoch 2
    resumed = train(storage, "resumed", [fault(tmp_path, 1, step_in_epoch_2)], max_failures=1)

    assert whole.status == resumed.status == "finished", (whole.error, resumed.error)
    assert [(f.kind, f.rank) for f in resumed.failures] == [("exception", 1)]
    expected, got = saved_state(whole), saved_state(resumed)
    assert got["epoch"] == EPOCHS - 1
    first = expected["first_batches"]
    assert len(first) == EPOCHS and first[0] != first[1]  # the epochs see different orders
    assert got["first_batches"] == first  # epoch 2 and 3, after the restart, too
    assert_bit_identical(got["model"], expected["model"])
