"""Training functions for tests/test_transformers.py written to Ray Train's Transformers guide
with `ray.train` renamed `ft_train` (importable by Dask worker processes). The ft-train-named
counterpart is the example itself, `ft_train.examples.gpt2_trainer:train_fn`; these share its
model, data and arguments, so that the two differ only in the names and the resume pattern."""

import os

import ft_train
from ft_train.examples import gpt2_trainer


def ray_guide(config):
    """Ray's pattern: add RayTrainReportCallback, prepare_trainer, then resume from
    `os.path.join(checkpoint_dir, RayTrainReportCallback.CHECKPOINT_NAME)`."""
    from transformers import Trainer

    from ft_train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    seed = config.get("seed", 0)
    trainer = Trainer(
        model=gpt2_trainer.tiny_gpt2(seed),
        args=gpt2_trainer.training_args(config),
        train_dataset=gpt2_trainer.CountingLanguage(seed, config.get("n_sequences", 512)),
    )
    trainer.add_callback(RayTrainReportCallback())
    trainer.add_callback(gpt2_trainer.step_hooks(config))
    trainer = prepare_trainer(trainer)

    checkpoint = ft_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            checkpoint_path = os.path.join(checkpoint_dir, RayTrainReportCallback.CHECKPOINT_NAME)
            trainer.train(resume_from_checkpoint=checkpoint_path)
    else:
        trainer.train()
