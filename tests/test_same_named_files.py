"""Ray's permissive checkpoint pattern, end to end: every rank saves its own state into
`state.pt` at every report (in Ray the last writer wins). DESIGN.md, storage invariant 3: the
lowest rank's file is stored and listed, a warning names the file, and every committed manifest
matches its bytes, so a rank killed right after a round costs nothing but the restart: the run
resumes from that round with rank 0's `state.pt`.

Real flow, 2 CPU ranks on a LocalCluster (gloo), a real SIGKILL, local storage and the loopback
S3 (whose conditional PUT, If-None-Match, is what keeps a rank's file from overwriting another's
there). The logic alone, in every upload order: tests/unit/test_file_collisions.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import ft_train
from ft_train.config import CheckpointConfig
from ft_train.controller.rounds import ReportRounds
from ft_train.protocol import Report
from ft_train.storage.checkpoint import Checkpoint
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.fs import DUPLICATES, side_path
from ft_train.storage.run_state import RunState, RunStore
from tests.helpers import fault, fresh, load_state, run_config

STEPS, KILLED_AT = 5, 3


def every_rank_saves(config):
    """Each rank saves {"step", "rank", a tensor whose size and values are the rank's own} into
    `state.pt` and attaches it at every report, uploaded in the background
    (`checkpoint_upload_mode="async"`) except at report `sync_at`; restores from `state.pt` and
    reports which rank's file it found. The ranks keep in step with an
    all-reduce a step, as a DDP backward would keep them. Faults at the top of a step (at step
    s, right after report s returned)."""
    import tempfile

    import torch.distributed as dist

    from ft_train.testing.faults import maybe_inject

    rank = ft_train.get_context().get_world_rank()
    step, restored_rank = 0, None
    if (checkpoint := ft_train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:  # verified against the manifest
            state = torch.load(os.path.join(d, "state.pt"))
        step, restored_rank = state["step"], state["rank"]
    resumed_from = step
    while step < config["steps"]:
        maybe_inject(config.get("faults"), rank, step)
        dist.all_reduce(torch.ones(1))
        step += 1
        with tempfile.TemporaryDirectory() as d:
            own = torch.full((64 * (rank + 1),), float(rank))
            torch.save({"step": step, "rank": rank, "own": own}, os.path.join(d, "state.pt"))
            ft_train.report(
                {"step": step, "resumed_from": resumed_from, "restored_rank": restored_rank},
                checkpoint=ft_train.Checkpoint.from_directory(d),
                checkpoint_upload_mode="sync" if step == config["sync_at"] else "async",
            )


class Collected(logging.Handler):
    """The driver's log lines: the controller logs through the task's run logger, whose Prefect
    logger does not propagate to the root (where caplog listens)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_killed_rank_resumes_from_its_round_with_rank_0s_file(prefect_api, storage, tmp_path):
    """Rank 1 is SIGKILLed right after report KILLED_AT returned, which both ranks uploaded
    before returning (sync: the guarantee is about that round); the other reports upload in the
    background, so that the side paths' info also comes through `Uploads` and the journals."""
    from flows.train import train

    collected = Collected()
    loggers = [logging.getLogger(n) for n in ("prefect.task_runs", "prefect.flow_runs", "ft_train")]
    for logger in loggers:
        logger.addHandler(collected)
    try:
        result = train(
            train_loop=every_rank_saves,
            train_loop_config={
                "steps": STEPS,
                "sync_at": KILLED_AT,
                "faults": [fault(tmp_path, 1, KILLED_AT, "kill")],
            },
            scaling_config=ft_train.ScalingConfig(num_workers=2),
            run_config=run_config(storage, "same-named", max_failures=1),
        )
    finally:
        for logger in loggers:
            logger.removeHandler(collected)

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank) for f in result.failures] == [("process_death", 1)]
    # resumed from the round the rank was killed right after, from rank 0's file
    assert result.metrics["resumed_from"] == KILLED_AT, result.metrics
    assert result.metrics["restored_rank"] == 0, result.metrics
    assert any("'state.pt' by ranks 0, 1" in line for line in collected.lines), collected.lines

    # every committed checkpoint: its manifest verifies, its state.pt is rank 0's of that round
    state = load_state(storage, "same-named")
    # the reports before the kill whose background uploads it cut short were never committed
    committed = [c.report_index for c in state.checkpoints]
    assert set(range(KILLED_AT, STEPS + 1)) <= set(committed) <= set(range(1, STEPS + 1))
    store = fresh(storage)
    for entry in state.checkpoints:
        path = f"{state.name}/{entry.dir_name}"
        restored = tmp_path / f"restored-{entry.report_index}"
        Checkpoint(store.uri(path), storage.options).download_verified(str(restored))
        saved = torch.load(restored / "state.pt")
        assert (saved["step"], saved["rank"]) == (entry.report_index, 0), entry.dir_name
        assert DUPLICATES not in store.list_dir(path), entry.dir_name


# -- the uploads on each storage, in a chosen order (no cluster) -----------------------------------


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (2, 1)], ids=["0-1-2", "2-1-0", "2-1"])
def test_uploads_in_any_order_commit_the_lowest_ranks_bytes(storage, tmp_path, order):
    """What the ranks' exclusive creates do on this storage (on S3, a PUT with If-None-Match),
    driven one rank after the other: the lowest rank's bytes are committed and listed, also
    where the highest rank's file is empty (s3fs writes an empty file unconditionally unless
    asked otherwise), and nothing of the side paths is left."""
    st, name = fresh(storage), "uploads"
    dir_name = checkpoint_dir_name(1, 0, "0a" * 16)
    sent = {}
    for rank in order:
        local = tmp_path / f"rank-{rank}"
        local.mkdir()
        (local / "state.pt").write_bytes(f"rank {rank} ".encode() * (rank + 1))
        (local / "small").write_bytes(b"" if rank == max(order) else f"{rank}".encode())
        sent[rank] = st.upload_dir(str(local), f"{name}/{dir_name}", rank=rank)
    rounds = ReportRounds(world_size=3, last_index=0)
    for rank in range(3):
        rounds.add(Report(rank, 1, {}, dir_name if rank in sent else None, sent.get(rank, {})))
    rnd = rounds.pop_complete()
    manager = CheckpointManager(st, RunStore(st, name), CheckpointConfig())
    manager.commit(RunState(name=name), rnd.dir_name, 1, {}, rnd.files, 0)

    restored = tmp_path / "restored"
    Checkpoint(st.uri(f"{name}/{dir_name}"), storage.options).download_verified(str(restored))
    lowest = min(order)
    assert (restored / "state.pt").read_bytes() == f"rank {lowest} ".encode() * (lowest + 1)
    assert (restored / "small").read_bytes() == f"{lowest}".encode()
    assert DUPLICATES not in st.list_dir(f"{name}/{dir_name}")
    # the first rank to upload a name holds it; a later rank > 0 went to its side path
    later = [r for r in order[1:] if r > 0]
    assert all(sent[r]["state.pt"].get("at") == side_path(r, "state.pt") for r in later)
