"""Hugging Face Transformers on ft-train: a `Trainer` fine-tune of a tiny GPT-2, built from a
config (no download), on a synthetic language, data-parallel over the ranks.

A plain Transformers script with three additions, each one line: `ReportCallback()` in the
Trainer's callbacks (every save the Trainer makes becomes an ft-train checkpoint),
`prepare_trainer(trainer)` (checks that the Trainer sees ft-train's group), and
`with resume_from_checkpoint() as path: trainer.train(resume_from_checkpoint=path)` (after a
failure, the Trainer resumes from the latest committed checkpoint: weights, optimizer,
scheduler, every rank's RNG, its global_step and data position).

    ft-train run ft_train.examples.gpt2_trainer:train_fn --name gpt2-1 --workers 2 \\
        --config max_steps=60 --config save_steps=20
    python -m ft_train.examples.gpt2_trainer            # from Python: TorchTrainer(...).fit()
    prefect deployment run 'ft-train/gpt2-trainer'      # the deployment in prefect.yaml

Config keys (all optional): max_steps (default 40; -1 to train `epochs` epochs), epochs,
save_strategy ("steps" or "epoch"), save_steps, save_total_limit, logging_steps, batch_size, lr,
seed, n_sequences (the data set's size, 512), output_dir (the Trainer's, shared by the ranks of
a host; default under the temporary directory, named after the run), step_s (seconds of
simulated compute a step) and faults (`ft_train.testing.faults`, at the top of a step: step s is
after s steps).

Transformers is imported inside the training function, not with the module: the driver imports
this module to check that `train_fn` exists, and Transformers' import costs seconds.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import ft_train
from ft_train.testing.faults import maybe_inject

VOCAB, SEQ_LEN, N_SEQUENCES = 64, 16, 512


class CountingLanguage(Dataset):
    """Sequences that count in steps (start, start + stride, ... mod VOCAB): a next-token task a
    one-layer GPT-2 learns in a few dozen steps. Fixed by `seed`: the same on every rank."""

    def __init__(self, seed: int, n: int = N_SEQUENCES):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(seed)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)


def training_args(config: dict[str, Any]):
    """The Trainer's arguments from the run's config; `output_dir` one per host, shared by its
    ranks."""
    from transformers import TrainingArguments

    output_dir = config.get("output_dir") or os.path.join(
        tempfile.gettempdir(), "ft-train-gpt2", ft_train.get_context().get_experiment_name()
    )
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=config.get("max_steps", 40),
        num_train_epochs=config.get("epochs", 1),
        per_device_train_batch_size=config.get("batch_size", 8),
        learning_rate=config.get("lr", 3e-3),
        save_strategy=config.get("save_strategy", "steps"),
        save_steps=config.get("save_steps", 10),
        save_total_limit=config.get("save_total_limit"),
        logging_steps=config.get("logging_steps", 5),
        seed=config.get("seed", 0),
        report_to=[],
        ddp_find_unused_parameters=False,  # every GPT-2 parameter takes part in each step
        disable_tqdm=True,
    )


def step_hooks(config: dict[str, Any]):
    """A TrainerCallback for the example's tests: injected faults (`faults`) at the top of a
    step, and simulated compute (`step_s`) at its end."""
    from transformers import TrainerCallback

    rank = ft_train.get_context().get_world_rank()

    class StepHooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            maybe_inject(config.get("faults"), rank, state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if step_s := config.get("step_s"):
                time.sleep(step_s)  # stands in for a bigger model's compute

    return StepHooks()


def train_fn(config: dict[str, Any]) -> None:
    from transformers import Trainer

    from ft_train.integrations.transformers import (
        ReportCallback,
        prepare_trainer,
        resume_from_checkpoint,
    )

    seed = config.get("seed", 0)
    trainer = Trainer(
        model=tiny_gpt2(seed),
        args=training_args(config),
        train_dataset=CountingLanguage(seed, config.get("n_sequences", N_SEQUENCES)),
        callbacks=[ReportCallback(), step_hooks(config)],
    )
    trainer = prepare_trainer(trainer)  # refuses a Trainer that does not see ft-train's group
    with resume_from_checkpoint() as checkpoint:  # None on a fresh run
        trainer.train(resume_from_checkpoint=checkpoint)


if __name__ == "__main__":  # python -m ft_train.examples.gpt2_trainer
    import ft_train.torch

    result = ft_train.torch.TorchTrainer(
        # by import path: the ranks import the module, not this script's __main__
        "ft_train.examples.gpt2_trainer:train_fn",
        train_loop_config={"max_steps": 60, "save_steps": 20},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name="gpt2", failure_config=ft_train.FailureConfig(max_failures=3)
        ),
        # the workers' fork server imports Transformers once: a restart's ranks have it at once
        cluster=ft_train.ClusterConfig(
            preload=("transformers.trainer", "transformers.models.gpt2.modeling_gpt2")
        ),
    ).fit()
    print(result.metrics)
