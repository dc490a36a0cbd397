"""Hugging Face Transformers' `Trainer` on ft-train's ranks: report each checkpoint the Trainer
saves, and resume from the latest committed one.

Three pieces, each usable alone:
- `ReportCallback`, a `TrainerCallback`: at every save the Trainer makes (`on_save`, with
  `save_strategy="steps"` or `"epoch"`, and the save at the end of training) every rank calls
  `ft_train.report()` once, with the latest logged metrics (each key's last value in the
  Trainer's log history, plus `step` and `epoch`) and the files of the Trainer's
  `checkpoint-N` folder that it wrote: rank 0 the model, optimizer, scheduler, trainer state
  and its own RNG state; every other rank only its own RNG state (`rng_state_{rank}.pth`). The
  committed checkpoint holds them together under `CHECKPOINT_NAME` ("checkpoint", Ray's
  layout), so one `output_dir` shared by the ranks of a host (as users write it) and one per
  host both work, and no file is attached twice.
- `resume_from_checkpoint()`: a context manager that yields the local directory of that
  `checkpoint/` folder in the latest committed checkpoint (`ft_train.get_checkpoint()`), or None
  on a fresh run: `with resume_from_checkpoint() as path: trainer.train(resume_from_checkpoint=path)`.
  The Trainer then restores model, optimizer, scheduler, every rank's RNG, and its
  `global_step` and data position from it.
- `prepare_trainer(trainer)` (Ray's name): checks, before any step, that the Trainer's own
  distributed set-up (accelerate) is ft-train's group: the same world size and rank. ft-train's
  rank processes set torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, ...) and have the default process group initialised, which accelerate's
  `PartialState` takes over as it is.

`save_total_limit` deletes old `checkpoint-N` folders in `output_dir` only after the callback
has reported them (the Trainer rotates at the next save, after every rank's report of this one
has returned); ft-train keeps its own copies by `CheckpointConfig(num_to_keep)`.

Importing this module imports transformers (`pip install "ft-train[transformers]"`);
`import ft_train` never does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import ft_train
from ft_train.errors import ConfigError

CHECKPOINT_NAME = "checkpoint"

# The RNG state file each rank of a distributed Trainer writes (`Trainer._save_rng_state`)
_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")


def rank_files(folder: str, rank: int) -> list[str]:
    """The files of the Trainer's checkpoint folder `folder` that rank `rank` wrote, as paths
    relative to it: rank 0 every file but the other ranks' RNG states; another rank only its
    own RNG state (where it is in `folder`: a rank on another host sees only its host's)."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            own_rng = (m := _RNG_FILE.fullmatch(rel)) is not None and int(m.group(1)) == rank
            if own_rng or (rank == 0 and m is None):
                found.append(rel)
    return sorted(found)


def _link_or_copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)  # no copy of a model's bytes; the Trainer never rewrites a saved file
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)


def latest_metrics(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key's last value in the Trainer's log history (training loss, learning rate,
    evaluation metrics, ...): what it has logged by this save."""
    metrics: dict[str, Any] = {}
    for entry in log_history:
        metrics.update(entry)
    return metrics


class ReportCallback(TrainerCallback):
    """Reports every checkpoint the Trainer saves to ft-train (see the module docstring).

    Every rank's `on_save` calls `ft_train.report()` exactly once per save, as ft-train's
    report() contract asks. Set `logging_steps` (and the evaluation strategy) so that the metrics
    you select checkpoints by (`CheckpointConfig.checkpoint_score_attribute`) are logged by each
    save, as Ray's guide asks of its `RayTrainReportCallback`.
    """

    CHECKPOINT_NAME = CHECKPOINT_NAME

    def on_save(self, args, state, control, **kwargs):
        metrics = {**latest_metrics(state.log_history), "step": state.global_step}
        metrics["epoch"] = state.epoch
        # The folder the Trainer has just written (`Trainer._save_checkpoint`): named after the
        # step, not found by modification time, which a shared output_dir's other ranks and a
        # killed attempt's leftovers would confuse.
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        files = rank_files(folder, args.process_index) if os.path.isdir(folder) else []
        if not files:  # e.g. save_only_model on a rank that saves no model
            ft_train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="ft-train-hf-") as d:
            for rel in files:
                _link_or_copy(os.path.join(folder, rel), os.path.join(d, CHECKPOINT_NAME, rel))
            # sync upload (the default): stored before report() returns and `d` goes
            ft_train.report(metrics, checkpoint=ft_train.Checkpoint.from_directory(d))


@contextlib.contextmanager
def resume_from_checkpoint() -> Iterator[str | None]:
    """The local directory of the Trainer's checkpoint folder in the latest committed
    checkpoint, for `trainer.train(resume_from_checkpoint=...)`, or None on a fresh run (the
    Trainer then starts from step 0). Read-only; it stays until the block ends, so train inside
    it. A committed checkpoint with no such folder (reported by other code) is refused."""
    checkpoint = ft_train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as d:
        path = os.path.join(d, CHECKPOINT_NAME)
        if not os.path.isdir(path):
            raise ft_train.SessionError(
                f"the latest checkpoint {checkpoint.path} has no {CHECKPOINT_NAME}/ folder: it "
                "was not reported by ft_train.integrations.transformers.ReportCallback; resume "
                "it with your own code, or add ReportCallback() to the Trainer's callbacks"
            )
        yield path


def prepare_trainer(trainer: Trainer) -> Trainer:
    """Check that `trainer` trains on ft-train's group; return it.

    Its distributed set-up (accelerate's, from TrainingArguments) must see ft-train's world
    size and this rank: a Trainer whose arguments were built outside the training function
    would train each rank alone, on its own data. Refused naming the fix (a ConfigError: no
    restart can fix it). Without a `ReportCallback` no checkpoint reaches ft-train unless a
    callback of the user's own reports one: a warning, not an error. Ray's `prepare_trainer`
    also wires Ray Data iterables into the Trainer; ft-train has no Ray Data, and plain
    datasets need nothing.
    """
    ctx = ft_train.get_context()
    args = trainer.args
    if (args.world_size, args.process_index) != (ctx.get_world_size(), ctx.get_world_rank()):
        raise ConfigError(
            f"the Trainer sees world size {args.world_size}, process {args.process_index}; "
            f"ft-train's group is {ctx.get_world_size()} ranks, this one rank "
            f"{ctx.get_world_rank()}: build TrainingArguments and the Trainer inside the "
            "training function, where ft-train has set RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT"
        )
    if not any(isinstance(cb, ReportCallback) for cb in trainer.callback_handler.callbacks):
        warnings.warn(
            "the Trainer has no ft_train.integrations.transformers.ReportCallback: unless a "
            "callback of your own calls ft_train.report(), no checkpoint reaches ft-train and "
            "a restart trains from step 0; add callbacks=[ReportCallback()] to the Trainer",
            stacklevel=2,
        )
    return trainer
