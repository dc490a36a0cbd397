"""The run-state document and what is read back from it: `RunStore` and `TrainResult.from_path`,
against a local path and the loopback S3 endpoint (the `storage` fixture). No Prefect, no Dask:
runs are built with the library's own storage, commit and run-state calls.
"""

from __future__ import annotations

import json
import os

import pytest

import ft_train
from ft_train.config import CheckpointConfig
from ft_train.errors import StorageError
from ft_train.storage.checkpoint import MANIFEST
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.fs import Storage, local_files
from ft_train.storage.run_state import (
    INDEX_DIR,
    SCHEMA_VERSION,
    STATE_FILE,
    AttemptRecord,
    CheckpointEntry,
    FailureRecord,
    RunState,
    RunStore,
)
from tests.helpers import fresh

ATTEMPT_ID = "5e" * 16


def read_tree(root: str) -> dict[str, bytes]:
    out = {}
    for rel in local_files(root):
        if rel != MANIFEST:
            with open(os.path.join(root, rel), "rb") as f:
                out[rel] = f.read()
    return out


def commit(
    storage: Storage, state: RunState, cfg: CheckpointConfig, index: int, metrics: dict, tmp_path
) -> str:
    """Upload a checkpoint's files as a rank would, and commit it as the driver does."""
    dir_name = checkpoint_dir_name(index, 0, ATTEMPT_ID)
    local = tmp_path / f"ckpt-{state.name}-{index}"
    local.mkdir()
    (local / "model.pt").write_bytes(f"weights at {index}".encode())
    files = storage.upload_dir(str(local), f"{state.name}/{dir_name}")
    CheckpointManager(storage, RunStore(storage, state.name), cfg).commit(
        state, dir_name, index, metrics, files, attempt=0
    )
    return dir_name


# -- RunStore -----------------------------------------------------------------------------------


def test_run_state_round_trips(storage):
    store = RunStore(fresh(storage), "round-trip")
    assert store.load() is None  # a fresh run
    state = RunState(
        name="round-trip",
        config_fingerprint="abc123",
        report_index=7,
        latest=None,
        failures=[FailureRecord(kind="process_death", rank=1, step=5, error="SIGKILL")],
        attempts=[AttemptRecord(attempt=0, attempt_id=ATTEMPT_ID, world_size=2)],
        driver_runs=2,
    )
    store.save(state)
    loaded = RunStore(fresh(storage), "round-trip").load()
    assert loaded.model_dump() == state.model_dump()
    # One document and nothing else: no temporary file is left beside it.
    assert fresh(storage).list_dir("round-trip") == [STATE_FILE]


def test_unknown_fields_are_ignored_and_missing_ones_take_defaults(storage):
    """A run written by another ft-train of the same schema stays readable."""
    doc = {
        "schema_version": SCHEMA_VERSION,
        "name": "other-version",
        "added_later": {"x": 1},
        "checkpoints": [{"dir_name": "checkpoint_000001-a0-00", "report_index": 1, "new": True}],
        "latest": "checkpoint_000001-a0-00",
    }
    fresh(storage).write_atomic(f"other-version/{STATE_FILE}", json.dumps(doc).encode())
    state = RunStore(fresh(storage), "other-version").load()
    assert state.latest_entry().report_index == 1
    assert state.status == "running" and state.failures == [] and state.driver_runs == 0


@pytest.mark.parametrize("raw", [b"[]", b'"a string"', b"null", b"\xff\xfe"])
def test_a_document_that_is_not_a_run_state_is_refused(storage, raw):
    fresh(storage).write_atomic(f"not-a-state/{STATE_FILE}", raw)
    with pytest.raises(StorageError, match=STATE_FILE):
        RunStore(fresh(storage), "not-a-state").load()


def test_run_state_is_plain_json(storage):
    store = RunStore(fresh(storage), "plain")
    store.save(RunState(name="plain", failures=[FailureRecord(kind="hang", error="no progress")]))
    doc = json.loads(fresh(storage).read_bytes(f"plain/{STATE_FILE}"))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["failures"][0]["kind"] == "hang"


def test_a_schema_1_document_with_every_checkpoint_in_it_loads_and_goes_on(storage, tmp_path):
    """Schema 1 (before sealed chunks) kept every retained checkpoint in the one document. It
    reads as a head with no sealed chunks; its next commits seal, and nothing is lost."""
    name, n = "schema-1", 10
    storage_ = fresh(storage)
    entries = [
        CheckpointEntry(
            dir_name=checkpoint_dir_name(i, 0, ATTEMPT_ID), report_index=i, metrics={"step": i}
        )
        for i in range(1, n + 1)
    ]
    doc = RunState(
        name=name, checkpoints=entries, latest=entries[-1].dir_name, report_index=n
    ).model_dump(mode="json")
    del doc["sealed_chunks"]
    doc["schema_version"] = 1
    storage_.write_atomic(f"{name}/{STATE_FILE}", json.dumps(doc).encode())

    state = RunStore(fresh(storage), name).load()
    assert state.sealed_chunks == 0 and state.checkpoints == entries
    assert state.latest_entry().report_index == n
    assert RunStore(fresh(storage), name).all_checkpoints(state) == entries

    manager = CheckpointManager(
        storage_, RunStore(storage_, name), CheckpointConfig(), index_chunk=4
    )
    dir_name = checkpoint_dir_name(n + 1, 1, ATTEMPT_ID)
    manager.commit(state, dir_name, n + 1, {"step": n + 1}, {}, attempt=1)
    saved = RunStore(fresh(storage), name).load()
    assert saved.schema_version == SCHEMA_VERSION and saved.sealed_chunks == 2  # 8 sealed at once
    assert [e.report_index for e in saved.checkpoints] == [9, 10, 11]
    result = ft_train.TrainResult.from_path(storage.path, name, storage_options=storage.options)
    assert [m["step"] for _, m in result.best_checkpoints] == list(range(1, n + 2))
    assert result.checkpoint.path.endswith(f"/{dir_name}")


def test_a_missing_sealed_chunk_gives_a_clear_storage_error(storage):
    name = "lost-chunk"
    storage_ = fresh(storage)
    RunStore(storage_, name).save(RunState(name=name, sealed_chunks=2))
    RunStore(storage_, name).write_chunk(0, [CheckpointEntry(dir_name="c1", report_index=1)])
    state = RunStore(fresh(storage), name).load()  # the head alone loads
    with pytest.raises(StorageError, match=f"{INDEX_DIR}/000001.json is missing"):
        RunStore(fresh(storage), name).all_checkpoints(state)
    with pytest.raises(StorageError, match="is missing"):
        ft_train.TrainResult.from_path(storage.path, name, storage_options=storage.options)


# -- TrainResult.from_path ----------------------------------------------------------------------


def test_result_from_path_of_a_finished_run(storage, tmp_path):
    name = "finished-run"
    cfg = CheckpointConfig(
        num_to_keep=3, checkpoint_score_attribute="loss", checkpoint_score_order="min"
    )
    storage_ = fresh(storage)
    state = RunState(name=name)
    names = [
        commit(storage_, state, cfg, i, {"loss": loss, "step": i}, tmp_path)
        for i, loss in enumerate([0.5, 0.2, 0.9, 0.4], start=1)
    ]
    state.status, state.final_metrics = "finished", {"loss": 0.4, "step": 4, "epoch": 2}
    RunStore(storage_, name).save(state)

    result = ft_train.TrainResult.from_path(
        storage.path, name, storage_options=storage.options, checkpoint_config=cfg
    )

    assert result.last_metrics == {"loss": 0.4, "step": 4, "epoch": 2}
    assert result.status == "finished" and result.error is None
    assert result.path == f"{storage.path}/{name}"
    assert result.checkpoint.path == f"{storage.path}/{name}/{names[3]}"  # the latest
    restored = result.checkpoint.to_directory(str(tmp_path / "restored"))
    assert read_tree(restored) == {"model.pt": b"weights at 4"}
    # The 3 best (0.9 was dropped), ascending by score as in Ray: the best is last.
    assert [(c.path.rsplit("/", 1)[1], m["loss"]) for c, m in result.best_checkpoints] == [
        (names[0], 0.5),
        (names[3], 0.4),
        (names[1], 0.2),
    ]
    for ckpt, metrics in result.best_checkpoints:
        assert ckpt.manifest()["metrics"] == metrics


def test_result_from_path_of_a_failed_run(storage, tmp_path):
    name = "failed-run"
    storage_ = fresh(storage)
    state = RunState(name=name)
    latest = commit(storage_, state, CheckpointConfig(), 1, {"loss": 1.5}, tmp_path)
    state.failures.append(FailureRecord(kind="exception", rank=0, step=2, error="boom"))
    state.status, state.error = "failed", "training failed: 1 failures exceed max_failures=0"
    RunStore(storage_, name).save(state)

    result = ft_train.TrainResult.from_path(storage.path, name, storage_options=storage.options)

    assert result.last_metrics == {"loss": 1.5}  # the latest checkpoint's, with no final metrics
    assert result.checkpoint.path.endswith(f"/{latest}")
    assert isinstance(result.error, ft_train.TrainingFailedError)
    assert "max_failures" in str(result.error)
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("exception", 0, 2)]
    assert result.error.failures[0]["error"] == "boom"


def test_result_from_path_of_a_missing_run(storage):
    with pytest.raises(StorageError, match="no run named 'never-ran'"):
        ft_train.TrainResult.from_path(storage.path, "never-ran", storage_options=storage.options)
