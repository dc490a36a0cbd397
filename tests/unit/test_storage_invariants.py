"""Storage invariants that need no storage: which checkpoints retention keeps, and checkpoint
directory names (the rest, on a local path and on S3, are in `tests/test_storage_invariants.py`)."""

from __future__ import annotations

import math
import random

import pytest

from ft_train.config import CheckpointConfig
from ft_train.storage.checkpoint_manager import checkpoint_dir_name, retained
from ft_train.storage.run_state import (
    CheckpointEntry,
)
from tests.write_path import (
    ATTEMPT_0,
)


def test_same_attempt_number_from_another_driver_gets_another_directory():
    """A driver killed before it recorded its attempt: the next one reuses the attempt number,
    never the directory (the attempt id differs)."""
    first = checkpoint_dir_name(5, 0, "3f2a" * 8)
    second = checkpoint_dir_name(5, 0, "9c1e" * 8)
    assert first != second
    assert checkpoint_dir_name(5, 0, ATTEMPT_0) != checkpoint_dir_name(5, 1, ATTEMPT_0)


@pytest.mark.parametrize("order", ["max", "min"])
@pytest.mark.parametrize("num_to_keep", [1, 2, 3])
def test_retained_keeps_the_latest_and_the_best(order, num_to_keep):
    """Property check of `retained` over random histories (seeded): the latest is always kept,
    at most num_to_keep others, and nothing dropped outranks a kept non-latest checkpoint."""
    rng = random.Random(f"{order}-{num_to_keep}")
    cfg = CheckpointConfig(
        num_to_keep=num_to_keep, checkpoint_score_attribute="score", checkpoint_score_order=order
    )

    def goodness(e: CheckpointEntry) -> float:
        v = e.metrics.get("score")
        if not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
            return -math.inf  # missing, NaN (stored as the string "nan") rank worst
        return v if order == "max" else -v

    for _ in range(200):
        entries: list[CheckpointEntry] = []
        for i in range(1, rng.randint(1, 8) + 1):
            metrics = rng.choice(
                [{"score": rng.choice([0.1, 0.5, 0.9, rng.random()])}, {}, {"score": "nan"}]
            )
            entries.append(CheckpointEntry(dir_name=f"c{i}", report_index=i, metrics=metrics))
            latest = entries[-1].dir_name
            kept = retained(entries, latest, cfg)
            assert latest in kept
            assert kept == [e.dir_name for e in entries if e.dir_name in kept]  # commit order
            others = [e for e in entries if e.dir_name in kept and e.dir_name != latest]
            assert len(others) <= num_to_keep
            dropped = [e for e in entries if e.dir_name not in kept]
            if dropped:
                assert len(kept) >= num_to_keep
                worst_kept = min(goodness(e) for e in others) if others else math.inf
                assert all(goodness(d) <= worst_kept for d in dropped)
            entries = [e for e in entries if e.dir_name in kept]
