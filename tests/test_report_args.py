"""report()'s Ray arguments on the real flow (2 CPU ranks on a local Dask cluster, gloo):
`checkpoint_dir_name` labels, `CheckpointUploadMode` with `delete_local_checkpoint_after_upload`,
Checkpoint metadata through a committed checkpoint, and `get_all_reported_checkpoints()` across
a restart; a label used twice, and ranks that disagree on a round's label, fail the run at once.

The training functions write what they saw into files under the test's directory (the ranks run
in other processes); the test reads them and the run state once the flow has returned."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

import ft_train
from ft_train import CheckpointUploadMode
from ft_train.storage.checkpoint_manager import CHECKPOINT_DIR, label_of
from ft_train.testing.faults import maybe_inject
from tests.conftest import StorageTarget, on_storage
from tests.helpers import load_state


def listing() -> list[dict]:
    return [
        {
            "label": label_of(os.path.basename(r.checkpoint.path)),
            "metrics": r.metrics,
            "metadata": r.checkpoint.get_metadata(),
            "status": r.status.value,
        }
        for r in ft_train.get_all_reported_checkpoints()
    ]


def ray_args_loop(config):
    """A checkpoint at every step, named f"step_{step}"; rank 0's carries metadata {"step"}.
    Odd steps upload with CheckpointUploadMode.ASYNC (Ray's default: the local directory is
    deleted), even steps with SYNC (kept). Each rank notes whether its directory survived
    report(). A resumed rank finds its step in the restored checkpoint's metadata; rank 0 lists
    the reported checkpoints after a restart and at the end, and the faulted rank lists them just
    before its fault (which waits for its own checkpoints' commits)."""
    ctx = ft_train.get_context()
    rank, attempt, out = ctx.get_world_rank(), ctx.get_attempt(), Path(config["out"])
    start = 0
    if (restored := ft_train.get_checkpoint()) is not None:
        start = restored.get_metadata()["step"]
        if rank == 0:
            (out / f"listed-after-restart-a{attempt}.json").write_text(json.dumps(listing()))
    for step in range(start + 1, config["steps"] + 1):
        if any((f["rank"], f["step"]) == (rank, step) for f in config["faults"]):
            if not os.path.exists(config["faults"][0]["marker"]):
                (out / f"listed-before-fault-r{rank}.json").write_text(json.dumps(listing()))
        maybe_inject(config["faults"], rank, step)
        d = tempfile.mkdtemp(prefix="ray-args-")
        Path(d, f"rank{rank}.txt").write_text(str(step))
        checkpoint = ft_train.Checkpoint.from_directory(d)
        if rank == 0:
            checkpoint.set_metadata({"step": step})
        mode = CheckpointUploadMode.ASYNC if step % 2 else CheckpointUploadMode.SYNC
        ft_train.report(
            {"step": step},
            checkpoint=checkpoint,
            checkpoint_dir_name=f"step_{step}",
            checkpoint_upload_mode=mode,
        )
        (out / f"kept-r{rank}-s{step}").write_text(json.dumps(os.path.isdir(d)))
    if rank == 0:
        (out / "listed-at-end.json").write_text(json.dumps(listing()))


def bad_label_loop(config):
    """Two reports with a checkpoint from every rank: named "same" both times ("duplicate"), or
    with a name of each rank's own ("conflict")."""
    rank = ft_train.get_context().get_world_rank()
    label = "same" if config["case"] == "duplicate" else f"rank{rank}"
    for step in (1, 2):
        d = tempfile.mkdtemp(prefix="bad-label-")
        Path(d, f"rank{rank}.txt").write_text(str(step))
        ft_train.report({"step": step}, ft_train.Checkpoint.from_directory(d), label)


def train(storage: StorageTarget, name: str, loop: str, config: dict, max_failures: int):
    from flows.train import train as flow

    return flow(
        train_loop=f"tests.test_report_args:{loop}",
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=storage.path,
            storage_options=storage.options,
            failure_config=ft_train.FailureConfig(max_failures=max_failures),
        ),
    )


@pytest.mark.usefixtures("prefect_api")
@on_storage("s3")
def test_rays_report_arguments_on_the_flow_across_a_restart(storage, tmp_path):
    out = tmp_path / "seen"
    out.mkdir()
    fault = {"rank": 1, "step": 3, "kind": "raise", "marker": str(tmp_path / "fault")}
    config = {"steps": 4, "faults": [fault], "out": str(out)}
    result = train(storage, "ray-args", "ray_args_loop", config, max_failures=1)

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank) for f in result.failures] == [("exception", 1)]
    labels = [f"step_{s}" for s in (1, 2, 3, 4)]
    # the label ends each checkpoint's path; the directory keeps the report index and attempt
    assert [label_of(os.path.basename(c.path)) for c, _ in result.best_checkpoints] == labels
    assert result.checkpoint.path.endswith("-step_4")
    name = os.path.basename(result.checkpoint.path)
    assert CHECKPOINT_DIR.match(name) and name.startswith("checkpoint_000004-a1-")
    state = load_state(storage, "ray-args")
    assert [c.dir_name.split("-")[1] for c in state.checkpoints] == ["a0", "a0", "a1", "a1"]
    assert state.attempts[1].restored_from.endswith("-step_2")

    # metadata: set on the local directory, read back from the committed checkpoint, on a rank
    # (the restart resumed at its step) and on the driver; a committed one is read-only
    assert result.checkpoint.get_metadata() == {"step": 4}
    with pytest.raises(ft_train.SessionError, match="read-only"):
        result.checkpoint.set_metadata({"step": 5})

    def seen(file: str) -> list:
        return json.loads((out / file).read_text())

    committed = [
        {
            "label": f"step_{s}",
            "metrics": {"step": s},
            "metadata": {"step": s},
            "status": "COMMITTED",
        }
        for s in (1, 2, 3, 4)
    ]
    # rank 1 waited for its own checkpoints (steps 1 and 2) to be committed before its fault
    assert seen("listed-before-fault-r1.json") == committed[:2]
    assert seen("listed-after-restart-a1.json") == committed[:2]  # the earlier attempt's
    assert seen("listed-at-end.json") == committed

    # delete_local_checkpoint_after_upload: Ray's default, True for ASYNC (odd steps) only
    for rank in (0, 1):
        kept = {s: seen(f"kept-r{rank}-s{s}") for s in (1, 2, 3, 4)}
        assert kept == {1: False, 2: True, 3: False, 4: True}, (rank, kept)


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize(
    "case, words",
    [
        ("duplicate", ["checkpoint_dir_name='same'", "report 1 of this attempt already has"]),
        ("conflict", ["different checkpoint_dir_name", "rank 0: 'rank0', rank 1: 'rank1'"]),
    ],
)
def test_a_reused_label_or_ranks_that_disagree_fail_the_run_at_once(tmp_path, case, words):
    storage = StorageTarget("local", str(tmp_path / "runs"))
    with pytest.raises(ft_train.SessionError) as err:
        train(storage, f"label-{case}", "bad_label_loop", {"case": case}, max_failures=2)
    for word in words:
        assert word in str(err.value), str(err.value)
    state = load_state(storage, f"label-{case}")
    assert state.status == "failed" and len(state.attempts) == 1  # not retried
    assert not any(f.charged for f in state.failures)
    committed = [c.dir_name for c in state.checkpoints]
    if case == "duplicate":  # the first checkpoint named "same" stays; the second never uploaded
        assert len(committed) == 1 and label_of(committed[0]) == "same"
        on_storage = [n for n in os.listdir(storage.path + "/label-duplicate") if "same" in n]
        assert on_storage == committed
    else:
        assert committed == []
