"""The guarantee: once report() has returned on every rank for round k, round k's checkpoint is
committed even if a rank dies the next instant (`ft_train.worker.journal`); and each failure is charged
to what happened, at any step speed.

The loop (`tests.loops.fast_checkpoints`) takes a few ms a step, so a rank's last reports are
still queued in its process when it dies. Faults do nothing first that a real one would not:
no report is handed over, nothing is flushed.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import ft_train
from tests.helpers import assert_bit_identical, fresh, load_state, run_config

pytestmark = pytest.mark.usefixtures("prefect_api")

FAST = "tests.loops:fast_checkpoints"
EVERY = 4
RECORDED = {"kill": "process_death", "exit": "process_death", "raise": "exception"}
# Every kind at every distance from a checkpoint round k: at step k (the instant report k
# returned), k + 1, k + 2 and k + 3 (right before the next one). One fault a round, in order.
SCHEDULE = [
    (EVERY * (i + 1) + offset, kind)
    for i, (offset, kind) in enumerate(itertools.product(range(EVERY), RECORDED))
]
STEPS = 64  # both schedules end before the last two rounds


def train_fast(storage, name, config, max_failures) -> ft_train.TrainResult:
    from flows.train import train

    return train(
        train_loop=FAST,
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(storage, name, max_failures),
    )


def no_journal_left(storage, name) -> bool:
    """The ranks' journals of a finished run are gone from the node."""
    from ft_train.worker.journal import journal_root, run_key

    return not os.path.exists(os.path.join(journal_root(), run_key(storage.uri(name))))


def weights(result: ft_train.TrainResult) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "rank0.pt"))["model"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, prefect_api) -> dict[str, torch.Tensor]:
    """The final weights of the loop without faults (the same for every way of saving)."""
    from tests.conftest import StorageTarget

    target = StorageTarget("local", str(tmp_path_factory.mktemp("fault-free") / "runs"))
    result = train_fast(target, "fault-free", {"steps": STEPS, "every": EVERY}, 0)
    assert result.status == "finished" and not result.failures
    return weights(result)


@pytest.mark.parametrize("saving", ["rank0-sync", "sharded-sync", "rank0-async"])
def test_a_round_every_rank_reported_survives_the_death_of_a_rank(
    storage, tmp_path, saving, fault_free
):
    who, mode = saving.split("-")
    faults = [
        {"rank": 1, "step": step, "kind": kind, "marker": str(tmp_path / f"fault-{step}")}
        for step, kind in SCHEDULE
    ]
    config = {
        "steps": STEPS,
        "every": EVERY,
        "sharded": who == "sharded",
        "mode": mode,
        "faults": faults,
    }
    name = f"rounds-{saving}-{storage.kind}"
    result = train_fast(storage, name, config, max_failures=len(SCHEDULE))

    assert result.status == "finished", result.error
    # each failure charged to what happened, with the last report the rank returned from
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [
        (RECORDED[kind], 1, step) for step, kind in SCHEDULE
    ]
    # each restart from the round every rank had reported: not an earlier one, not scratch
    state = load_state(storage, name)
    assert [a.start_report_index for a in state.attempts] == [0] + [
        step - step % EVERY for step, _ in SCHEDULE
    ]
    assert all(a.restored_from for a in state.attempts[1:])
    assert_bit_identical(weights(result), fault_free)
    assert no_journal_left(fresh(storage), name)


RECORDED_CHAOS = {**RECORDED, "hang": "hang"}
# 28 faults two steps apart, on both ranks, of every kind a rank can do to itself; each one
# fires once, so the run replays up to two steps after each restart
CHAOS = [
    (2 * (i + 1), i % 2, kind)
    for i, kind in enumerate(["kill", "raise", "exit", "kill", "exit", "raise", "hang"] * 4)
]
assert max(s for s, _ in SCHEDULE) < STEPS - EVERY and max(s for s, _, _ in CHAOS) < STEPS - EVERY
HANG_TIMEOUT_S = 3.0  # collectives time out at 0.8 x this: a hung rank's peer fails first


@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_chaos_at_a_few_ms_a_step_finishes_bit_exact_with_every_fault_recorded(
    storage, tmp_path, fault_free
):
    from flows.train import train

    faults = [
        {"rank": rank, "step": step, "kind": kind, "marker": str(tmp_path / f"fault-{step}")}
        for step, rank, kind in CHAOS
    ]
    name = "chaos-fast"
    result = train(
        train_loop=FAST,
        train_loop_config={"steps": STEPS, "every": EVERY, "faults": faults},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(
            storage,
            name,
            failure_config=ft_train.FailureConfig(max_failures=-1, hang_timeout_s=HANG_TIMEOUT_S),
        ),
    )

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [
        (RECORDED_CHAOS[kind], rank, step) for step, rank, kind in CHAOS
    ]
    state = load_state(storage, name)
    assert [a.start_report_index for a in state.attempts] == [0] + [
        step - step % EVERY for step, _, _ in CHAOS
    ]
    assert_bit_identical(weights(result), fault_free)
