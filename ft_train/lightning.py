"""Ray Train's `ray.train.lightning`, renamed: `RayDDPStrategy`, `RayFSDPStrategy`,
`RayLightningEnvironment`, `RayTrainReportCallback` (with `CHECKPOINT_NAME`) and `prepare_trainer`
are the very objects of `ft_train.integrations.lightning` (`DDPStrategy`, `FSDPStrategy`,
`FtTrainEnvironment`, `ReportCallback`, `prepare_trainer`), so a script that follows Ray's
Lightning guide runs after renaming `ray.train` to `ft_train`, resuming as Ray's guide does::

    checkpoint = ft_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as ckpt_dir:
            ckpt_path = os.path.join(ckpt_dir, RayTrainReportCallback.CHECKPOINT_NAME)
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)

Which Lightning package: as in Ray, `lightning` (`lightning.pytorch`) where it is installed, else
`pytorch_lightning`; except that where this module is first imported after `pytorch_lightning`
alone (`import pytorch_lightning as pl` above it), it serves `pytorch_lightning` (Ray would hand
such a script `lightning`'s classes, which its Trainer refuses). To choose explicitly, import the
same objects from `ft_train.integrations.lightning` or `ft_train.integrations.pytorch_lightning`.

`RayDeepSpeedStrategy` is refused (a ConfigError naming what to use): DeepSpeed is neither
installed with ft-train nor tested on its ranks.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from .errors import ConfigError
from .integrations.lightning_classes import CHECKPOINT_NAME, build


def _package() -> str:
    imported = [p for p in ("lightning", "pytorch_lightning") if p in sys.modules]
    if len(imported) == 1:
        return imported[0]
    return "lightning" if importlib.util.find_spec("lightning") else "pytorch_lightning"


_classes = build(_package())

RayLightningEnvironment = _classes.FtTrainEnvironment
RayDDPStrategy = _classes.DDPStrategy
RayFSDPStrategy = _classes.FSDPStrategy
RayTrainReportCallback = _classes.ReportCallback
prepare_trainer = _classes.prepare_trainer

__all__ = [
    "CHECKPOINT_NAME",
    "RayDDPStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayTrainReportCallback",
    "prepare_trainer",
]

_REFUSED = {
    "RayDeepSpeedStrategy": (
        "DeepSpeed is not installed with ft-train nor tested on its ranks: use "
        "`ft_train.lightning.RayFSDPStrategy` (sharded, on GPU) or `ft_train.lightning.RayDDPStrategy`"
    ),
}


def __getattr__(name: str) -> Any:
    # A ConfigError, not an AttributeError: `from m import x` would replace the latter's message.
    if name in _REFUSED:
        raise ConfigError(
            f"ray.train.lightning.{name} is Ray Train's, and ft-train does not offer it: "
            f"{_REFUSED[name]} (docs/frameworks.md)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
