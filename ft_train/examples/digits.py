"""The demo: an MLP on scikit-learn's bundled handwritten digits, data-parallel over the ranks.

It reads top to bottom like a plain training script, and keeps in each checkpoint everything a
bit-exact resume needs: model and optimizer state, the data position (epoch, next batch), the
global step, and every rank's RNG state (each rank attaches its own file to the same checkpoint).

Config keys (all optional): epochs, batch_size, lr, hidden, dropout, seed, checkpoint_every,
loader_workers (DataLoader processes per rank), faults (see ft_train.testing.faults; also read
from its FAULTS_ENV, as `ft-train demo` injects its crash). After an elastic
resize the data position is rescaled to the new number of ranks; resumes at the same size are
bit-exact.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ft_train
import ft_train.torch
from ft_train.testing.faults import from_environment, maybe_inject

N_TRAIN = 1500  # of 1797 images; the rest is the validation set


def datasets() -> tuple[TensorDataset, TensorDataset]:
    # Imported here, not with the module: the driver imports the module to check that the loop
    # exists, and scikit-learn's import would cost it seconds on every run.
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)  # shipped inside scikit-learn: no download
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def build_model(hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
    )


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        x, y = (t.to(device) for t in data.tensors)
        acc = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return acc


def get_rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def train_loop(config: dict[str, Any]) -> None:
    epochs, seed = config.get("epochs", 4), config.get("seed", 0)
    checkpoint_every = config.get("checkpoint_every", 10)
    rank = ft_train.get_context().get_world_rank()
    faults = [*(config.get("faults") or ()), *from_environment()]

    train_set, val_set = datasets()
    loader, sampler = make_loader(train_set, config, seed)
    torch.manual_seed(seed)  # the same initial weights on every rank
    net = build_model(config.get("hidden", 128), config.get("dropout", 0.1))
    model = ft_train.torch.prepare_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05), momentum=0.9)
    raw_model = getattr(model, "module", model)
    torch.manual_seed(seed + 1000 * (rank + 1))  # each rank's own dropout stream

    epoch, batch, step = restore(raw_model, optimizer, rank)
    resumed_from = step if ft_train.get_checkpoint() is not None else None

    loss_fn = nn.CrossEntropyLoss()
    while epoch < epochs:
        sampler.set_epoch(epoch)  # the epoch's order, the same after a restart
        for i, (x, y) in enumerate(loader):
            if i < batch:
                continue  # already trained on before the checkpoint we resumed from
            maybe_inject(faults, rank, step)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            batch = i + 1
            if batch == len(loader):
                epoch, batch = epoch + 1, 0
            metrics = dict(step=step, epoch=epoch, loss=loss.item(), resumed_from=resumed_from)
            metrics["total_steps"] = epochs * len(loader)  # the UI's progress: step of this
            if done := epoch == epochs:
                metrics["val_accuracy"] = accuracy(raw_model, val_set)
            checkpointed = step % checkpoint_every == 0 or done
            if checkpointed:
                report_with_checkpoint(metrics, rank, raw_model, optimizer, epoch, batch, step)
            else:
                ft_train.report(metrics)
            if ft_train.get_preemption_info() is not None:
                # A worker is leaving: every rank learned it at this same call (or at the
                # report just before: each call is an agreement point). Save a
                # just-in-time checkpoint (unless this step just did) and stop; the run goes
                # on from it on other workers.
                if not checkpointed:
                    report_with_checkpoint(metrics, rank, raw_model, optimizer, epoch, batch, step)
                return
            if done:
                return


def make_loader(
    train_set: TensorDataset, config: dict[str, Any], seed: int
) -> tuple[DataLoader, DistributedSampler]:
    """The rank's shard of the training set, shuffled the same way on every rank and resume,
    and its sampler. A DistributedSampler of its own (kept by prepare_data_loader), not
    `shuffle=True`: at one rank, as after an elastic shrink, a loader keeps its own sampler,
    and a RandomSampler's order would not follow the epoch."""
    ctx = ft_train.get_context()
    sampler: DistributedSampler = DistributedSampler(
        train_set,
        num_replicas=ctx.get_world_size(),
        rank=ctx.get_world_rank(),
        shuffle=True,
        seed=seed,
    )
    loader = DataLoader(
        train_set,
        batch_size=config.get("batch_size", 64),
        sampler=sampler,
        num_workers=config.get("loader_workers", 0),
        generator=torch.Generator().manual_seed(seed),  # keeps the global RNG for dropout alone
    )
    return ft_train.torch.prepare_data_loader(loader), sampler


def restore(model, optimizer, rank: int) -> tuple[int, int, int]:
    """Load the latest checkpoint, if any, into `model` and `optimizer` (and this rank's RNG);
    the (epoch, batch, step) to go on from, (0, 0, 0) on a fresh run."""
    checkpoint = ft_train.get_checkpoint()
    if checkpoint is None:
        return 0, 0, 0
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "train_state.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, batch, step = state["epoch"], state["batch"], state["step"]
        world, saved_world = ft_train.get_context().get_world_size(), state.get("world_size")
        if saved_world and saved_world != world:  # an elastic resize: same samples seen,
            batch = batch * saved_world // world  # as near as the new sharding allows
        rng = os.path.join(d, f"rng_rank{rank}.pt")
        if os.path.exists(rng):
            set_rng_state(torch.load(rng, weights_only=False))
    return epoch, batch, step


def report_with_checkpoint(metrics, rank, model, optimizer, epoch, batch, step) -> None:
    """Everything a bit-exact resume needs: rank 0 saves the training state, every rank its RNG."""
    with tempfile.TemporaryDirectory() as d:
        torch.save(get_rng_state(), os.path.join(d, f"rng_rank{rank}.pt"))
        if rank == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "batch": batch,
                "step": step,
                "world_size": ft_train.get_context().get_world_size(),
            }
            torch.save(state, os.path.join(d, "train_state.pt"))
        ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(d))
