"""PyTorch Lightning (the `pytorch_lightning` package) on ft-train's ranks: a
`ClusterEnvironment`, DDP and FSDP strategies on ft-train's process group, a callback that reports
every checkpoint Lightning saves, `prepare_trainer`, and `resume_from` to resume by `ckpt_path`.
With the `lightning` package (`lightning.pytorch`), import the same names from
`ft_train.integrations.lightning`. `pip install pytorch-lightning`; `import ft_train`
does not import this module. The classes are built in `ft_train.integrations.lightning_classes`
(which says what each does); Ray's names for them are in `ft_train.lightning`.

    import pytorch_lightning as pl
    from ft_train.integrations.pytorch_lightning import (
        DDPStrategy, FtTrainEnvironment, ReportCallback, prepare_trainer, resume_from)

    def train_fn(config):
        trainer = pl.Trainer(max_epochs=4, strategy=DDPStrategy(),
                             plugins=[FtTrainEnvironment()], callbacks=[ReportCallback()])
        trainer = prepare_trainer(trainer)
        with resume_from() as ckpt_path:  # the latest committed checkpoint, or None
            trainer.fit(MyModule(), datamodule=MyData(), ckpt_path=ckpt_path)
"""

from .lightning_classes import CHECKPOINT_NAME, build, resume_from

_classes = build("pytorch_lightning")

FtTrainEnvironment = _classes.FtTrainEnvironment
DDPStrategy = _classes.DDPStrategy
FSDPStrategy = _classes.FSDPStrategy
ReportCallback = _classes.ReportCallback
prepare_trainer = _classes.prepare_trainer

__all__ = [
    "CHECKPOINT_NAME",
    "DDPStrategy",
    "FSDPStrategy",
    "FtTrainEnvironment",
    "ReportCallback",
    "prepare_trainer",
    "resume_from",
]
