"""A tiny PyTorch Lightning training function for tests/test_lightning.py (importable by Dask
worker processes, and by `ft-train run tests.lightning_loops:train_fn`).

Config: `package` ("lightning" or "pytorch_lightning"), `names` ("ft": ft-train's
`ft_train.integrations.<package>`, resuming with `resume_from`; "ray": Ray's `ft_train.lightning`,
resuming as Ray's guide does), `max_steps`, `every` (ReportCallback's every_n_train_steps),
`output_dir` (the Trainer's default_root_dir, shared by the ranks of a host, as users write it),
`faults` (ft_train.testing.faults, at the top of the step with this global step), `step_s`
(seconds of simulated compute a step), `fsdp` (FSDP on GPU: "full" or "sharded", its
state_dict_type; default DDP on CPU). The metrics carry `start_step`: the global step the Trainer
started at (the resumed checkpoint's, or 0).
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import ft_train
from ft_train.testing.faults import maybe_inject


def names(package: str, kind: str) -> dict[str, Any]:
    """The integration's objects as `kind` ("ft" or "ray") spells them."""
    if kind == "ray":
        import ft_train.lightning as ray

        assert ray.RayDDPStrategy.__module__ == f"ft_train.integrations.{package}"
        return {
            "strategy": ray.RayDDPStrategy,
            "fsdp": ray.RayFSDPStrategy,
            "environment": ray.RayLightningEnvironment,
            "callback": ray.RayTrainReportCallback,
            "prepare_trainer": ray.prepare_trainer,
        }
    ours = importlib.import_module(f"ft_train.integrations.{package}")
    return {
        "strategy": ours.DDPStrategy,
        "fsdp": ours.FSDPStrategy,
        "environment": ours.FtTrainEnvironment,
        "callback": ours.ReportCallback,
        "prepare_trainer": ours.prepare_trainer,
    }


def module_class(pl: Any) -> type:
    class Tiny(pl.LightningModule):
        """A linear regression; logs its loss and the global step training started at."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.start_step = 0

        def on_train_start(self) -> None:
            self.start_step = self.trainer.global_step  # after a restore: the checkpoint's

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            self.log("start_step", float(self.start_step))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Tiny


def fault_callback(pl: Any, config: dict[str, Any]) -> Any:
    class Faults(pl.Callback):
        """Faults at the top of a step, numbered by the global step; the step's compute time."""

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            maybe_inject(config.get("faults"), trainer.global_rank, trainer.global_step)
            if config.get("step_s"):
                time.sleep(config["step_s"])  # the step's compute, not a synchronisation

    return Faults()


def train_fn(config: dict[str, Any]) -> None:
    package = config.get("package", "lightning")
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else package)
    api = names(package, config.get("names", "ft"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)  # the same initial weights on every rank
    fsdp = config.get("fsdp")
    trainer = pl.Trainer(
        max_steps=config["max_steps"],
        accelerator="gpu" if fsdp else "cpu",
        devices=1,
        strategy=api["fsdp"](state_dict_type=fsdp) if fsdp else api["strategy"](),
        plugins=[api["environment"]()],
        callbacks=[
            api["callback"](every_n_train_steps=config.get("every")),
            fault_callback(pl, config),
        ],
        default_root_dir=config["output_dir"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = api["prepare_trainer"](trainer)
    model, loader = module_class(pl)(), DataLoader(data, batch_size=4)
    if config.get("names", "ft") == "ray":  # Ray's guide, ray.train renamed
        checkpoint = ft_train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as ckpt_dir:
                ckpt_path = os.path.join(ckpt_dir, api["callback"].CHECKPOINT_NAME)
                trainer.fit(model, loader, ckpt_path=ckpt_path)
        else:
            trainer.fit(model, loader)
        return
    resume_from = importlib.import_module(f"ft_train.integrations.{package}").resume_from
    with resume_from() as ckpt_path:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
