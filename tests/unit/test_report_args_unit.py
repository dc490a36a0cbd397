"""report()'s Ray arguments, Checkpoint metadata and get_all_reported_checkpoints, without a
cluster: the argument checks (`ft_train.report_config`), the checkpoint directory's name with a
label, a `Session` reporting into a local storage directory (its messages collected in a list),
and a Checkpoint's metadata before and after its commit (the driver's own `CheckpointManager`
commits it)."""

from __future__ import annotations

import json
import os

import pytest

import ft_train
from ft_train import CheckpointConsistencyMode, CheckpointUploadMode
from ft_train.config import CheckpointConfig
from ft_train.controller.rounds import Round, label_conflict
from ft_train.errors import CheckpointDamagedError, SessionError
from ft_train.protocol import RankSpec
from ft_train.report_config import checkpoint_label, delete_after_upload, upload_mode
from ft_train.storage.checkpoint import MANIFEST, METADATA, Checkpoint
from ft_train.storage.checkpoint_manager import (
    CHECKPOINT_DIR,
    CheckpointManager,
    checkpoint_dir_name,
    label_of,
)
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore
from ft_train.worker.session import Session
from tests.rank_specs import rank_spec

ATTEMPT_ID = "c0ffee" + "0" * 26


def spec(storage: Storage, attempt: int = 0, attempt_id: str = ATTEMPT_ID) -> RankSpec:
    return rank_spec(storage, attempt=attempt, attempt_id=attempt_id, collective_timeout_s=1800.0)


def local_checkpoint(root, name: str, files: dict[str, bytes] | None = None) -> str:
    d = os.path.join(root, name)
    os.makedirs(d)
    for rel, data in (files or {"model.pt": b"weights"}).items():
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)
    return d


def commit(storage: Storage, state: RunState, msg) -> None:
    """What the driver does with a round's message: the manifest, then the run state."""
    manager = CheckpointManager(storage, RunStore(storage, "run"), CheckpointConfig())
    manager.commit(state, msg.dir_name, msg.index, msg.metrics, msg.files, 0)


# -- the arguments ------------------------------------------------------------------------------


def test_upload_modes_take_rays_enum_and_ft_trains_strings_and_refuse_no_upload():
    assert [m.value for m in CheckpointUploadMode] == ["ASYNC", "SYNC", "NO_UPLOAD"]
    assert [m.value for m in CheckpointConsistencyMode] == ["COMMITTED", "VALIDATED"]
    assert upload_mode(CheckpointUploadMode.SYNC) == upload_mode("sync") == "sync"
    assert upload_mode(CheckpointUploadMode.ASYNC) == upload_mode("async") == "async"
    with pytest.raises(SessionError, match=r"NO_UPLOAD\) is not supported.*SYNC.*ASYNC"):
        upload_mode(CheckpointUploadMode.NO_UPLOAD)
    for bad in ("SYNC", "no_upload", None, 1):
        with pytest.raises(SessionError, match="CheckpointUploadMode.SYNC"):
            upload_mode(bad)


def test_delete_after_upload_defaults_as_ray_for_the_enum_only():
    assert delete_after_upload(None, CheckpointUploadMode.ASYNC) is True
    assert delete_after_upload(None, CheckpointUploadMode.SYNC) is False
    assert delete_after_upload(None, "async") is False  # ft-train's own string keeps its meaning
    assert delete_after_upload(True, "sync") is True
    assert delete_after_upload(False, CheckpointUploadMode.ASYNC) is False
    with pytest.raises(SessionError, match="True, False, or None"):
        delete_after_upload("yes", "sync")


@pytest.mark.parametrize("label", ["epoch_3", "step=1200", "checkpoint_2026-01-02_03-04-05.123456"])
def test_a_label_ends_the_directory_name_after_the_index_and_the_attempt(label):
    assert checkpoint_label(label) == label
    name = checkpoint_dir_name(12, 1, ATTEMPT_ID, label)
    assert name == f"checkpoint_000012-a1-c0ffee00-{label}"
    m = CHECKPOINT_DIR.match(name)
    assert m is not None and int(m.group(1)) == 12 and label_of(name) == label
    # the names of today's runs still parse (orphan collection, retention), with no label
    plain = checkpoint_dir_name(12, 1, ATTEMPT_ID)
    assert CHECKPOINT_DIR.match(plain) and label_of(plain) is None
    assert label_of(checkpoint_dir_name(3, 0, "abcdef12", "abc-def")) == "abc-def"


@pytest.mark.parametrize("label", ["", ".", "..", "a/b", "../x", ".hidden", "a b", "é", "x" * 201])
def test_a_label_that_is_not_one_plain_path_segment_is_refused(label):
    with pytest.raises(SessionError, match="one path segment"):
        checkpoint_label(label)
    with pytest.raises(SessionError, match="pass a string"):
        checkpoint_label(3)


def test_ranks_that_disagree_on_a_rounds_label_are_refused_by_the_driver():
    agree = Round(4, {}, dir_name="d", labels={0: "epoch_1", 1: "epoch_1"})
    assert label_conflict(agree) is None
    differ = Round(4, {}, dir_name="d", labels={0: "epoch_1", 1: None})
    assert "rank 0: 'epoch_1', rank 1: None" in label_conflict(differ)


# -- a Session reporting into local storage -----------------------------------------------------


def test_upload_fn_validation_and_no_upload_are_refused_before_anything_is_stored(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    ckpt = Checkpoint.from_directory(local_checkpoint(tmp_path, "c"))
    with pytest.raises(SessionError, match="checkpoint_upload_fn=.*storage_options"):
        session.report({}, ckpt, checkpoint_upload_fn=lambda c, d: c)
    with pytest.raises(SessionError, match="validation=True.*validate in the training function"):
        session.report({}, ckpt, validation=True)
    with pytest.raises(SessionError, match="NO_UPLOAD"):
        session.report({}, ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    with pytest.raises(SessionError, match="one path segment"):
        session.report({}, ckpt, checkpoint_dir_name="../elsewhere")
    assert msgs == [] and session.report_index == 0 and not os.path.exists(tmp_path / "runs")


def test_a_label_is_refused_when_a_kept_checkpoint_or_this_attempt_has_it(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    c = Checkpoint.from_directory(local_checkpoint(tmp_path, "c"))
    session.report({"loss": 1.0}, c, "epoch_0")
    assert msgs[-1].dir_name == "checkpoint_000001-a0-c0ffee00-epoch_0"
    with pytest.raises(SessionError, match=r"'epoch_0'\) at report 2: report 1 of this attempt"):
        session.report({"loss": 0.5}, c, "epoch_0")
    assert session.report_index == 1  # refused before the report counted
    # metrics-only reports may repeat a name: there is no checkpoint to name
    session.report({"loss": 0.5}, checkpoint_dir_name="epoch_0")
    assert msgs[-1].label == "epoch_0" and msgs[-1].dir_name is None

    state = RunState(name="run")
    commit(st, state, msgs[0])
    # the next attempt: a committed checkpoint has the name; an uncommitted round's is free
    later = Session(spec(st, attempt=1, attempt_id="beef" * 8), [].append)
    with pytest.raises(SessionError, match="a committed checkpoint of this run already has"):
        later.report({}, c, "epoch_0")
    later.report({}, c, "epoch_1")


def test_delete_local_checkpoint_after_upload_removes_it_only_when_asked(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    kept = local_checkpoint(tmp_path, "sync-default")
    session.report({}, Checkpoint.from_directory(kept))
    assert os.path.isdir(kept)  # SYNC keeps it by default
    gone = local_checkpoint(tmp_path, "sync-deleted")
    session.report({}, Checkpoint.from_directory(gone), delete_local_checkpoint_after_upload=True)
    assert not os.path.exists(gone)
    async_dir = local_checkpoint(tmp_path, "async-default", {"a.bin": os.urandom(1 << 16)})
    session.report(
        {}, Checkpoint.from_directory(async_dir), checkpoint_upload_mode=CheckpointUploadMode.ASYNC
    )
    assert not os.path.exists(async_dir)  # Ray's default for ASYNC
    async_kept = local_checkpoint(tmp_path, "async-string")
    session.report({}, Checkpoint.from_directory(async_kept), checkpoint_upload_mode="async")
    assert os.path.isdir(async_kept)  # ft-train's "async" leaves it to the caller
    session.finish()
    stored = [m for m in msgs if m.dir_name]
    assert [m.index for m in stored] == [1, 2, 3, 4]
    assert stored[2].files.keys() == {"a.bin"}  # uploaded from the snapshot all the same
    session.close()


def test_a_committed_checkpoint_reported_again_is_never_deleted(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    session.report({}, Checkpoint.from_directory(local_checkpoint(tmp_path, "c")))
    commit(st, RunState(name="run"), msgs[0])
    committed = Checkpoint(st.uri(f"run/{msgs[0].dir_name}"))
    session.report({}, committed, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
    session.finish()
    assert os.path.isfile(os.path.join(committed.path, MANIFEST))
    with pytest.raises(SessionError, match="never deletes a committed checkpoint"):
        session.report({}, committed, delete_local_checkpoint_after_upload=True)
    session.close()


# -- metadata -----------------------------------------------------------------------------------


def test_metadata_is_a_file_of_the_checkpoint_and_a_committed_one_is_read_only(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    local = Checkpoint.from_directory(local_checkpoint(tmp_path, "c"))
    assert local.get_metadata() == {}
    local.set_metadata({"epoch": 3})
    local.update_metadata({"framework": "torch"})
    assert local.get_metadata() == {"epoch": 3, "framework": "torch"}
    with open(os.path.join(local.path, METADATA)) as f:
        assert json.load(f) == {"epoch": 3, "framework": "torch"}  # Ray's file, Ray's name
    with pytest.raises(TypeError, match="takes a dict"):
        local.set_metadata([1])
    with pytest.raises(TypeError, match="JSON-serialisable"):
        local.update_metadata({"x": object()})

    session = Session(spec(st), msgs.append)
    session.report({}, local)
    commit(st, RunState(name="run"), msgs[0])
    committed = Checkpoint(st.uri(f"run/{msgs[0].dir_name}"))
    assert METADATA in committed.manifest()["files"]
    assert committed.get_metadata() == {"epoch": 3, "framework": "torch"}
    with pytest.raises(SessionError, match="committed checkpoint is read-only"):
        committed.update_metadata({"epoch": 4})
    with committed.as_directory():  # still verifies against its manifest
        pass
    with open(os.path.join(committed.path, METADATA), "w") as f:
        json.dump({"epoch": 4, "framework": "torch"}, f)  # altered behind ft-train's back
    with pytest.raises(CheckpointDamagedError, match="does not match its manifest"):
        committed.get_metadata()


# -- get_all_reported_checkpoints ---------------------------------------------------------------


def test_all_reported_lists_the_committed_ones_and_waits_for_this_ranks_own(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    assert session.all_reported(CheckpointConsistencyMode.COMMITTED, None) == []
    c = Checkpoint.from_directory(local_checkpoint(tmp_path, "c"))
    session.report({"loss": 1.0}, c, "first")
    state = RunState(name="run")
    commit(st, state, msgs[0])
    session.report({"loss": 0.5}, c, "second")
    # report 2 is not committed: with a timeout, the list holds what is committed by then
    (only,) = session.all_reported(CheckpointConsistencyMode.VALIDATED, 0.05)
    assert only.checkpoint.path.endswith("-first") and only.metrics == {"loss": 1.0}
    assert only.status is ft_train.ReportedCheckpointStatus.COMMITTED
    commit(st, state, msgs[1])
    listed = session.all_reported(CheckpointConsistencyMode.COMMITTED, None)
    assert [r.metrics["loss"] for r in listed] == [1.0, 0.5]
    assert listed[1].checkpoint.path == st.uri(f"run/{msgs[1].dir_name}")
    with pytest.raises(SessionError, match="CheckpointConsistencyMode.COMMITTED"):
        session.all_reported("COMMITTED", None)
    with pytest.raises(SessionError, match="seconds"):
        session.all_reported(CheckpointConsistencyMode.COMMITTED, -1)


def test_a_labelled_checkpoint_left_uncommitted_is_an_orphan_and_a_committed_one_is_kept(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    c = Checkpoint.from_directory(local_checkpoint(tmp_path, "c"))
    session.report({}, c, "kept")
    session.report({}, c, "crashed")  # uploaded, never committed (the driver died first)
    state = RunState(name="run")
    commit(st, state, msgs[0])
    manager = CheckpointManager(st, RunStore(st, "run"), CheckpointConfig())
    assert manager.collect_orphans(state) == [msgs[1].dir_name]
    assert sorted(n for n in st.list_dir("run") if CHECKPOINT_DIR.match(n)) == [msgs[0].dir_name]
