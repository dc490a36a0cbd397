"""Ray Train's documented training functions, ported by renaming `ray.train` to `ft_train`
(importable by Dask workers as `tests.ray_patterns:fn`), for `tests/test_ray_compat.py`.

Each keeps the shape of its source (the restore logic, what each rank saves, where it reports and
where it fails) and fills in what the source leaves as `...`: a small model, data drawn from a
fixed seed, so that a resumed run can end bit-identical to an uninterrupted one. The additions
that are the test's, not Ray's: `maybe_inject(config["faults"], rank, step)` (a fault or a gate
at a (rank, step), `ft_train.testing.faults`), `time.sleep(config["step_s"])` (a step's compute
at a realistic pace) and a `resumed_from` metric (where the loop started).

Sources (ray-project/ray): `doc/source/train/doc_code/fault_tolerance.py` (worker fault
tolerance; the job-driver entrypoint, `tests/ray_entrypoint.py`; the just-in-time checkpoint on
preemption), `doc/source/train/getting-started-pytorch.rst` with the restore logic of
`doc/source/train/doc_code/checkpoints.py`, and `python/ray/train/v2/tests/test_persistence.py`.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import ft_train
import ft_train.torch
from ft_train.testing.faults import maybe_inject


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process, as a fresh run has
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a step: drawn from (step, rank) alone, so a resumed run sees the
    batches an uninterrupted one does."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _step(model, optimizer, x, y, config) -> float:
    if config.get("step_s"):
        time.sleep(config["step_s"])  # the step's compute at a realistic pace, not a sync
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def worker_fault_tolerance(config: dict) -> None:
    """The guide's `__worker_fault_tolerance_start__` example: [1] restore from
    `get_checkpoint()`, [2] every rank saves into a temporary directory and reports it at every
    step (in DDP every rank holds the same state, so the files are the same). The guide's
    entrypoint (`__job_driver_fault_tolerance_start__`) runs this same function."""
    rank = ft_train.get_context().get_world_rank()
    model = ft_train.torch.prepare_model(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    # [1] restore what the latest committed checkpoint holds
    checkpoint = ft_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as temp_checkpoint_dir:
            state = torch.load(os.path.join(temp_checkpoint_dir, "checkpoint.pt"))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"] + 1
    for step in range(start, config["num_steps"]):
        maybe_inject(config.get("faults"), rank, step)
        loss = _step(model, optimizer, *_batch(step, rank), config)
        # [2] save into a temporary directory and report it
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "step": step}, os.path.join(temp_checkpoint_dir, "checkpoint.pt"))
            ft_train.report(
                {"loss": loss, "step": step, "resumed_from": start},
                checkpoint=ft_train.Checkpoint.from_directory(temp_checkpoint_dir),
            )


def persistence(config: dict) -> None:
    """Ray's `test_persistence.py::train_fn` with a model: ranks in `no_checkpoint_ranks` report
    no checkpoint (rank 0 need not checkpoint), the others save a shared `checkpoint.pkl` (here
    with the model's state) and a shard of their own; at an iteration in `fail_iters` every rank
    raises right after `report()` returned. Ray's test needs `ray.train.collective.barrier()`
    before the raise, a workaround for a fast rank's failure overtaking the other ranks'
    checkpoints; this port has none: the round reported just before the error must be the one
    the restart resumes from."""
    rank = ft_train.get_context().get_world_rank()
    g = torch.Generator().manual_seed(rank)  # a toy dataset: this rank's (X, Y)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    model = ft_train.torch.prepare_model(_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = 0
    checkpoint = ft_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            with open(os.path.join(checkpoint_dir, "checkpoint.pkl"), "rb") as f:
                state = pickle.load(f)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["iter"] + 1
    for i in range(start, config["num_iterations"]):
        _step(model, optimizer, x, y, config)
        metrics = {"iter": i, "score": i, "resumed_from": start}
        if rank in config.get("no_checkpoint_ranks", []):
            ft_train.report(metrics, checkpoint=None)
        else:
            with tempfile.TemporaryDirectory() as temp_dir:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                with open(os.path.join(temp_dir, "checkpoint.pkl"), "wb") as f:
                    pickle.dump({**state, "iter": i}, f)
                with open(os.path.join(temp_dir, f"checkpoint_shard-rank={rank}.pkl"), "wb") as f:
                    pickle.dump({"iter": i}, f)
                ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(temp_dir))
                assert os.path.exists(temp_dir)  # report() leaves the directory to its owner
        if i in config.get("fail_iters", []):
            raise RuntimeError(f"Failing on iter={i}!!")


def _dataset(n: int = 64) -> TensorDataset:
    """A small fixed dataset, with each sample's index, so that a rank can tell which it saw."""
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g), torch.arange(n)
    )


def getting_started(config: dict) -> None:
    """The getting-started PyTorch loop (`getting-started-pytorch.rst`): a shuffled `DataLoader`
    through `prepare_data_loader`, `train_loader.sampler.set_epoch(epoch)` at each epoch, a
    checkpoint from every rank at each epoch's end; with the restore logic of the checkpointing
    guide (`checkpoints.py`, `__pytorch_restore_start__`: model.pt, optimizer.pt,
    extra_state.pt). Rank 0 reports the order of the samples it saw in the epoch."""
    ctx = ft_train.get_context()
    rank = ctx.get_world_rank()
    model = ft_train.torch.prepare_model(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loader = DataLoader(_dataset(), batch_size=8, shuffle=True)
    train_loader = ft_train.torch.prepare_data_loader(train_loader)
    start_epoch = 0
    checkpoint = ft_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            model.module.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt")))
            optimizer.load_state_dict(torch.load(os.path.join(checkpoint_dir, "optimizer.pt")))
            start_epoch = torch.load(os.path.join(checkpoint_dir, "extra_state.pt"))["epoch"] + 1
    for epoch in range(start_epoch, config["num_epochs"]):
        if ctx.get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        order = []
        for i, (x, y, index) in enumerate(train_loader):
            maybe_inject(config.get("faults"), rank, epoch * len(train_loader) + i)
            loss = _step(model, optimizer, x, y, config)
            order += index.tolist()
        metrics = {"loss": loss, "epoch": epoch, "order": order, "resumed_from": start_epoch}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            torch.save(model.module.state_dict(), os.path.join(temp_checkpoint_dir, "model.pt"))
            torch.save(optimizer.state_dict(), os.path.join(temp_checkpoint_dir, "optimizer.pt"))
            torch.save({"epoch": epoch}, os.path.join(temp_checkpoint_dir, "extra_state.pt"))
            ft_train.report(
                metrics, checkpoint=ft_train.Checkpoint.from_directory(temp_checkpoint_dir)
            )


def _save_checkpoint(model, optimizer, step: int, metrics: dict) -> None:
    """The guide's `save_checkpoint`: rank 0, which holds a full replica, saves; every rank
    reports, with or without a checkpoint."""
    with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
        checkpoint = None
        if ft_train.get_context().get_world_rank() == 0:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                os.path.join(temp_checkpoint_dir, "checkpoint.pt"),
            )
            checkpoint = ft_train.Checkpoint.from_directory(temp_checkpoint_dir)
        ft_train.report({"step": step, **metrics}, checkpoint=checkpoint)


def preemption_jit(config: dict) -> None:
    """The guide's `__preemption_jit_checkpoint_start__` example: every rank polls
    `get_preemption_info()` at every step (the same number of times on every rank) and saves
    one extra checkpoint when it is not None, then trains on until the run restarts; plus a
    rare periodic checkpoint every `checkpoint_every` steps and at the end (the guide's has
    none), which the restart must not fall back to."""
    rank = ft_train.get_context().get_world_rank()
    model = ft_train.torch.prepare_model(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start_step = 0
    # [1] the latest checkpoint may be a just-in-time one
    checkpoint = ft_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_step = state["step"] + 1
    saved_on_preemption = False
    num_steps, every = config["num_steps"], config["checkpoint_every"]
    for step in range(start_step, num_steps):
        maybe_inject(config.get("faults"), rank, step)
        _step(model, optimizer, *_batch(step, rank), config)
        metrics = {"resumed_from": start_step}
        # [2] polled at every step, on every rank alike
        preemption_info = ft_train.get_preemption_info()
        if preemption_info is not None and not saved_on_preemption:
            _save_checkpoint(model.module, optimizer, step, {**metrics, "jit": True})
            saved_on_preemption = True
        elif (step + 1) % every == 0 or step == num_steps - 1:
            _save_checkpoint(model.module, optimizer, step, {**metrics, "jit": False})
