"""PyTorch Lightning on ft-train: a small LightningModule (an MLP on scikit-learn's bundled
handwritten digits, no download) trained data-parallel by Lightning's own Trainer on ft-train's
ranks, with a checkpoint at each epoch's end that a restart resumes from.

What the Lightning script needs beyond plain Lightning (`ft_train.integrations.lightning`):
`strategy=DDPStrategy()` and `plugins=[FtTrainEnvironment()]` (Lightning on ft-train's process
group and ranks), `callbacks=[ReportCallback()]` (every checkpoint reported to ft-train),
`prepare_trainer(trainer)`, and `resume_from()` for `fit(ckpt_path=...)`. With the
`pytorch_lightning` package, import `pytorch_lightning as pl` and the same names from
`ft_train.integrations.pytorch_lightning`.

Run it (the fork server imports Lightning once, so that restarted ranks have it at once)::

    ft-train run ft_train.examples.lightning_digits:train_fn --workers 2 --name digits-pl \\
        --preload lightning.pytorch --config max_epochs=3

from Python: `python -m ft_train.examples.lightning_digits` (below), or as a deployment: the
`ft-train` flow with `train_loop="ft_train.examples.lightning_digits:train_fn"` and
`cluster={"preload": ["lightning.pytorch"]}` (docs/frameworks.md).

Config keys (all optional): max_epochs, max_steps, batch_size, lr, hidden, every_n_train_steps
(also report every that many steps; default: at epoch ends), output_dir (Lightning's
default_root_dir, shared by the ranks of a host), faults (ft_train.testing.faults, at the top of
the step with that global step).
"""

from __future__ import annotations

import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ft_train.integrations.lightning import (
    DDPStrategy,
    FtTrainEnvironment,
    ReportCallback,
    prepare_trainer,
    resume_from,
)
from ft_train.testing.faults import maybe_inject

N_TRAIN = 1500  # of 1797 images; the rest is the validation set


class DigitsModule(pl.LightningModule):
    """An MLP classifier of the 8x8 digit images."""

    def __init__(self, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        accuracy = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)  # over every rank's shard

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    # Imported here, not with the module: the driver imports the module to check that the loop
    # exists, and scikit-learn's import would cost it seconds on every run.
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)  # shipped inside scikit-learn: no download
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    train = TensorDataset(x[:N_TRAIN], y[:N_TRAIN])
    val = TensorDataset(x[N_TRAIN:], y[N_TRAIN:])
    # Lightning shards both over ft-train's ranks (DDPStrategy's DistributedSampler)
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=256)


class Faults(pl.Callback):
    """Test faults (ft_train.testing.faults) at the top of a step, by global step."""

    def __init__(self, faults: list[dict[str, Any]] | None) -> None:
        self.faults = faults

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        maybe_inject(self.faults, trainer.global_rank, trainer.global_step)


def train_fn(config: dict[str, Any]) -> None:
    """The training function, run on every rank."""
    train_loader, val_loader = loaders(config.get("batch_size", 32))
    pl.seed_everything(config.get("seed", 0))  # the same initial weights on every rank
    model = DigitsModule(config.get("hidden", 64), config.get("lr", 0.05))
    trainer = pl.Trainer(
        max_epochs=config.get("max_epochs", 2),
        max_steps=config.get("max_steps", -1),
        accelerator="auto",
        devices=1,  # one device a rank; the ranks are ft-train's
        strategy=DDPStrategy(),
        plugins=[FtTrainEnvironment()],
        callbacks=[
            ReportCallback(every_n_train_steps=config.get("every_n_train_steps")),
            Faults(config.get("faults")),
        ],
        default_root_dir=config.get("output_dir") or tempfile.gettempdir(),
        logger=False,
        enable_checkpointing=False,  # ReportCallback's checkpoints are the run's
        enable_progress_bar=False,
    )
    trainer = prepare_trainer(trainer)
    with resume_from() as ckpt_path:  # the latest committed checkpoint, or None
        trainer.fit(model, train_loader, val_loader, ckpt_path=ckpt_path)


if __name__ == "__main__":
    import ft_train
    import ft_train.torch

    result = ft_train.torch.TorchTrainer(
        # by import path: the ranks import the module, not this script's __main__
        "ft_train.examples.lightning_digits:train_fn",
        train_loop_config={"max_epochs": 3},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(name="lightning-digits"),
        cluster=ft_train.ClusterConfig(preload=("lightning.pytorch",)),
    ).fit()
    print(result.metrics)
