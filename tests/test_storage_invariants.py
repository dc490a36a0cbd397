"""The storage invariants of DESIGN.md ("Storage layout and commit protocol"), one test each, run
against a local path and the loopback S3 endpoint (the `storage` fixture).

Each test drives the real write path without Dask (`tests/write_path.py`): ranks are `Session`s
whose messages are collected with `send=list.append`, consolidated by the controller's
`ReportRounds`, and committed by `CheckpointManager`. Faults come from `FaultyStorage`, a real
`Storage` that records every mutating call and raises `Crash` in place of the k-th one: a crash of
the process at that point. After a crash, a fresh `Storage` and `RunStore` play the rerun: they
see only what reached storage.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from ft_train import TrainResult
from ft_train.config import CheckpointConfig, RunConfig, ScalingConfig
from ft_train.controller.rounds import ReportRounds
from ft_train.driver import prepare
from ft_train.errors import StorageError
from ft_train.storage.checkpoint import MANIFEST, Checkpoint
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import (
    INDEX_DIR,
    SCHEMA_VERSION,
    STATE_FILE,
    RunState,
    RunStore,
)
from tests.helpers import fresh
from tests.write_path import (
    ATTEMPT_0,
    ATTEMPT_1,
    NOOP,
    Crash,
    FaultyStorage,
    assert_references_restorable,
    commit_round,
    committed_run,
    load,
    merged,
    rank_files,
    report_round,
    restore,
    save,
    stored_files,
    stored_names,
)

# -- invariant 1: files, then the manifest, then the run state, then deletes -----------------------


def test_commit_writes_files_then_manifest_then_run_state_then_deletes(storage, tmp_path):
    name = "order"
    cfg = CheckpointConfig(num_to_keep=1)
    state, old = committed_run(storage, name, tmp_path, cfg)

    faulty = FaultyStorage(storage.path, storage.options)
    new, dropped = save(faulty, name, state, cfg, 2, rank_files("new"), tmp_path)

    assert new != old and dropped == [old]
    assert faulty.log == [
        ("upload", f"{name}/{new}"),  # rank 0's files
        ("upload", f"{name}/{new}"),  # rank 1's files
        ("write", f"{name}/{new}/{MANIFEST}"),  # the manifest, last of the checkpoint's files
        ("write", f"{name}/{STATE_FILE}"),  # the commit point
        ("delete", f"{name}/{old}"),  # only then retention deletes
    ]
    manifest = Checkpoint(fresh(storage).uri(f"{name}/{new}"), storage.options).manifest()
    assert set(manifest["files"]) == set(merged(rank_files("new")))  # every rank's files
    assert manifest["dir_name"] == new and manifest["report_index"] == 2
    assert load(storage, name).latest == new


def test_round_is_not_committed_until_every_rank_has_uploaded(storage, tmp_path):
    """A round (and so the manifest) is only formed once every rank's report() has returned,
    i.e. once every rank's upload is done."""
    msgs = report_round(fresh(storage), "partial", 1, rank_files("x"), {}, 0, ATTEMPT_0, tmp_path)
    rounds = ReportRounds(world_size=2, last_index=0)
    rounds.add(msgs[0])
    assert rounds.pop_complete() is None
    rounds.add(msgs[1])
    assert set(rounds.pop_complete().files) == set(merged(rank_files("x")))


def test_checkpoint_without_manifest_is_not_restorable(storage, tmp_path):
    storage_ = fresh(storage)
    msgs = report_round(storage_, "uncommitted", 1, rank_files("x"), {}, 0, ATTEMPT_0, tmp_path)
    ckpt = Checkpoint(storage_.uri(f"uncommitted/{msgs[0].dir_name}"), storage.options)
    with pytest.raises(StorageError, match="never committed"):
        ckpt.download_verified(str(tmp_path / "restore"))


# -- invariant 2: a crash at any point of a save leaves the previous checkpoint restorable ---------


def test_crash_at_any_point_of_a_save_leaves_a_restorable_checkpoint(storage, tmp_path):
    cfg = CheckpointConfig(num_to_keep=1)  # so the save also deletes the previous checkpoint
    old_files, new_files = merged(rank_files("old")), merged(rank_files("new"))

    # A save without a crash, to learn its mutating calls and where the commit point is.
    state, _ = committed_run(storage, "dry", tmp_path, cfg)
    dry = FaultyStorage(storage.path, storage.options)
    save(dry, "dry", state, cfg, 2, rank_files("new"), tmp_path)
    ops = [op for op, _ in dry.log]
    assert ops == ["upload", "upload", "write", "write", "delete"]
    manifest_at, commit_at = 3, 4  # 1-based positions of the manifest and run-state writes

    cases = [(k, False) for k in range(1, len(ops) + 2)]  # k = len(ops)+1: no crash
    cases += [(k, True) for k in range(1, len(ops) + 1) if ops[k - 1] == "upload"]
    for k, torn in cases:
        name = f"crash-{k}{'-torn' if torn else ''}"
        state, old = committed_run(storage, name, tmp_path, cfg)
        faulty = FaultyStorage(storage.path, storage.options, crash_at=k, torn=torn)
        new = checkpoint_dir_name(2, 0, ATTEMPT_0)
        try:
            save(faulty, name, state, cfg, 2, rank_files("new"), tmp_path)
            assert k == len(ops) + 1, f"no crash at call {k}"
        except Crash:
            assert k <= len(ops)

        # The rerun: a fresh storage and run store, one read of the run state.
        after = load(storage, name)
        expected, expected_files = (old, old_files) if k <= commit_at else (new, new_files)
        assert after.latest == expected, f"crash at call {k} ({ops[k - 1 : k]}, torn={torn})"
        restored = restore(storage, name, after.latest, tmp_path)
        assert restored == expected_files, f"crash at call {k}"
        assert_references_restorable(storage, name, after, tmp_path)
        if k <= manifest_at:  # the new directory may hold files, but it is not a checkpoint
            with pytest.raises(StorageError):
                restore(storage, name, new, tmp_path)

        # The run goes on: the next attempt resumes there and saves, and crash leftovers go.
        newer, _ = save(
            fresh(storage),
            name,
            after,
            cfg,
            after.report_index + 1,
            rank_files("retry"),
            tmp_path,
            attempt=1,
            attempt_id=ATTEMPT_1,
        )
        resumed = load(storage, name)
        assert resumed.latest == newer
        assert restore(storage, name, newer, tmp_path) == merged(rank_files("retry"))
        manager = CheckpointManager(fresh(storage), RunStore(fresh(storage), name), cfg)
        manager.collect_orphans(resumed)
        assert stored_names(storage, name) == {STATE_FILE, newer}


# -- invariant 3: a checkpoint directory never mixes files from two attempts -----------------------


def test_checkpoint_directory_never_mixes_attempts(storage, tmp_path):
    name = "attempts"
    cfg = CheckpointConfig()
    storage_ = fresh(storage)
    state = RunState(name=name)
    RunStore(storage_, name).save(state)
    save(storage_, name, state, cfg, 4, rank_files("base"), tmp_path)

    # Attempt A reports index 5 with a checkpoint, and dies before the driver commits it.
    files_a = [{"model.pt": b"A" * 10, "only_in_a.pt": b"A"}, {"rng_1.pt": b"A1"}]
    msgs_a = report_round(storage_, name, 5, files_a, {"loss": 1.0}, 0, ATTEMPT_0, tmp_path)
    # Attempt B restarts from index 4 and reports index 5 again, with other files.
    files_b = [{"model.pt": b"B" * 12}, {"rng_1.pt": b"B1", "only_in_b.pt": b"B"}]
    msgs_b = report_round(storage_, name, 5, files_b, {"loss": 0.5}, 1, ATTEMPT_1, tmp_path)
    manager = CheckpointManager(storage_, RunStore(storage_, name), cfg)
    dir_b, _ = commit_round(manager, state, msgs_b, 5, attempt=1)

    dir_a = msgs_a[0].dir_name
    assert dir_a != dir_b
    assert stored_files(storage, f"{name}/{dir_b}") == set(merged(files_b)) | {MANIFEST}
    assert stored_files(storage, f"{name}/{dir_a}") == set(merged(files_a))
    assert load(storage, name).latest == dir_b
    assert restore(storage, name, dir_b, tmp_path) == merged(files_b)


# -- invariant 4: retention keeps the latest, and deletes only what the state no longer references -


@pytest.mark.parametrize("order", ["max", "min"])
def test_retention_never_deletes_the_latest_even_when_it_scores_worst(storage, tmp_path, order):
    name = f"keep-latest-{order}"
    cfg = CheckpointConfig(
        num_to_keep=1, checkpoint_score_attribute="acc", checkpoint_score_order=order
    )
    scores = [0.9, 0.5, 0.1] if order == "max" else [0.1, 0.5, 0.9]  # each new one is worse
    storage_ = fresh(storage)
    state = RunState(name=name)
    names = []
    for i, score in enumerate(scores, start=1):
        dir_name, dropped = save(
            storage_, name, state, cfg, i, rank_files(f"s{i}"), tmp_path, metrics={"acc": score}
        )
        names.append(dir_name)
        saved = load(storage, name)
        assert saved.latest == dir_name
        kept = {names[0], dir_name}  # the best, and the latest however bad
        assert {e.dir_name for e in saved.checkpoints} == kept
        assert stored_names(storage, name) == kept | {STATE_FILE}
        assert restore(storage, name, dir_name, tmp_path) == merged(rank_files(f"s{i}"))
    assert dropped == [names[1]]  # the third save dropped the second, no longer latest


def test_retention_deletes_only_after_the_run_state_stops_referencing(storage, tmp_path):
    cfg = CheckpointConfig(num_to_keep=2)
    storage_ = fresh(storage)
    for crash_at in (5, None):  # right before the delete (call 5), and after it (no crash)
        name = f"delete-after-{crash_at}"
        state = RunState(name=name)
        for i in (1, 2):
            save(storage_, name, state, cfg, i, rank_files(f"s{i}"), tmp_path)
        first = state.checkpoints[0].dir_name
        seen: list[tuple[str, set[str]]] = []  # (deleted, what the stored state referenced then)

        def stored_refs_at_delete(path: str, name=name, seen=seen) -> None:
            refs = {e.dir_name for e in load(storage, name).checkpoints}
            seen.append((path.rsplit("/", 1)[1], refs))

        faulty = FaultyStorage(
            storage.path, storage.options, crash_at=crash_at, on_delete=stored_refs_at_delete
        )
        try:
            save(faulty, name, state, cfg, 3, rank_files("s3"), tmp_path)
            assert seen and seen[0][0] == first and first not in seen[0][1]
        except Crash:
            assert crash_at == 5 and faulty.log[-1] == ("write", f"{name}/{STATE_FILE}")
        saved = load(storage, name)
        assert first not in {e.dir_name for e in saved.checkpoints}
        assert_references_restorable(storage, name, saved, tmp_path)
        # After a crash: an orphan directory, never a reference to a deleted one.
        assert (first in stored_names(storage, name)) == (crash_at is not None)


# -- invariant 5: a rerun finds its state in O(1) reads, not by listing ----------------------------


LISTING = {"ls", "listdir", "find", "glob", "walk", "du", "expand_path", "scandir"}


class _CountingFS:
    """Forwards to a real filesystem and counts the methods called on it."""

    def __init__(self, fs, calls: Counter):
        self._fs, self._calls = fs, calls

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._fs, attr)
        if not callable(value):
            return value

        def counted(*args, **kwargs):
            self._calls[f"fs.{attr}"] += 1
            return value(*args, **kwargs)

        return counted


class CountingStorage(Storage):
    """A real Storage counting its own calls and its filesystem's."""

    def __init__(self, url, options=None, calls: Counter | None = None):
        super().__init__(url, options)
        self.calls = calls if calls is not None else Counter()

    @property
    def fs(self):
        return _CountingFS(super().fs, self.calls)

    @property
    def is_local(self) -> bool:
        return isinstance(super().fs, LocalFileSystem)

    def read_bytes(self, path):
        self.calls["read_bytes"] += 1
        return super().read_bytes(path)

    def write_atomic(self, path, data):
        self.calls["write_atomic"] += 1
        return super().write_atomic(path, data)

    def upload_dir(self, local_dir, path, should_stop=None, rank=0):
        self.calls["upload_dir"] += 1
        return super().upload_dir(local_dir, path, should_stop, rank)

    def download_files(self, path, rels, local_dir):
        self.calls["download_files"] += 1
        return super().download_files(path, rels, local_dir)

    def delete_dir(self, path):
        self.calls["delete_dir"] += 1
        return super().delete_dir(path)

    def list_dir(self, path):
        self.calls["list_dir"] += 1
        return super().list_dir(path)


def commit_tiny(
    storage: Storage,
    manager: CheckpointManager,
    state: RunState,
    index: int,
    attempt: int = 0,
    attempt_id: str = ATTEMPT_0,
) -> str:
    """A checkpoint of one tiny file: the rank's upload, then the driver's commit."""
    dir_name = checkpoint_dir_name(index, attempt, attempt_id)
    storage.write_atomic(f"{state.name}/{dir_name}/w.pt", b"w")
    files = {"w.pt": {"size": 1, "sha256": hashlib.sha256(b"w").hexdigest()}}
    manager.commit(state, dir_name, index, {"step": index}, files, attempt)
    return dir_name


def test_rerun_reads_its_state_in_constant_reads_without_listing(storage, tmp_path, monkeypatch):
    storage_ = fresh(storage)
    for name, n in (("few", 3), ("many", 60)):
        state = RunState(name=name)
        # Keep all, in chunks of 8: "many" has 7 sealed chunks and 4 entries in the head.
        manager = CheckpointManager(
            storage_, RunStore(storage_, name), CheckpointConfig(), index_chunk=8
        )
        for i in range(1, n + 1):
            commit_tiny(storage_, manager, state, i)
    assert load(storage, "many").sealed_chunks == 7

    counts = {}
    for name, n in (("few", 3), ("many", 60)):
        calls: Counter = Counter()
        assert RunStore(CountingStorage(storage.path, storage.options, calls), name).load()
        assert calls["read_bytes"] == 1, calls  # the head, and not one chunk
        calls.clear()
        monkeypatch.setattr(
            prepare, "Storage", lambda url, options=None, c=calls: CountingStorage(url, options, c)
        )
        plan = prepare.prepare_run(
            NOOP,
            {},
            ScalingConfig(),
            RunConfig(name=name, storage_path=storage.path, storage_options=storage.options),
            log=lambda msg: None,
        )
        assert isinstance(plan.storage, CountingStorage)  # the counter saw the driver's storage
        assert plan.state.latest == checkpoint_dir_name(n, 0, ATTEMPT_0)
        counts[name] = Counter(calls)  # before the release, which is not a rerun's read
        plan.release()

    assert counts["few"] == counts["many"], counts
    # the head twice: once before the lease (a state that cannot be resumed is refused with
    # nothing written), once under it (what counts); never a chunk. The driver's start then
    # sweeps crash leftovers: one listing of the run's directory (names only; one LIST request
    # per 1000 on S3), and no read of a checkpoint or of the sealed index
    # (`collect_orphans(read_index=False)`).
    assert counts["many"]["read_bytes"] == 2
    assert counts["many"]["list_dir"] == 1
    listings = {c: k for c, k in counts["many"].items() if c.removeprefix("fs.") in LISTING}
    assert listings == {"fs.ls": 1}, counts["many"]

    # A driver that ends (released its lease) sweeps its own leftovers on the way out, so the
    # rerun after it does not list the run's directory at all: only a killed driver's does.
    calls.clear()
    plan = prepare.prepare_run(
        NOOP,
        {},
        ScalingConfig(),
        RunConfig(name="many", storage_path=storage.path, storage_options=storage.options),
        log=lambda msg: None,
    )
    counted = Counter(calls)
    plan.release()
    assert plan.state.latest == checkpoint_dir_name(60, 0, ATTEMPT_0)
    assert counted["read_bytes"] == 2 and counted["list_dir"] == 0, counted


# -- the sealed checkpoint index: a head of bounded size, older entries in immutable chunks --------


def chunk_names(target, name: str) -> set[str]:
    return set(fresh(target).list_dir(f"{name}/{INDEX_DIR}"))


def test_keep_all_seals_old_entries_and_every_reader_of_the_full_list_sees_them(storage, tmp_path):
    name, n, chunk = "sealed", 45, 8
    storage_ = fresh(storage)
    state = RunState(name=name)
    manager = CheckpointManager(
        storage_, RunStore(storage_, name), CheckpointConfig(), index_chunk=chunk
    )
    names = []
    for i in range(1, n + 1):
        names.append(commit_tiny(storage_, manager, state, i))
        head = load(storage, name)
        assert 1 <= len(head.checkpoints) <= chunk and head.latest == names[-1]
        assert head.latest_entry().report_index == i
    assert head.sealed_chunks == 5  # 40 sealed, 5 in the head
    assert [e.dir_name for e in head.checkpoints] == names[40:]
    assert chunk_names(storage, name) == {f"{k:06d}.json" for k in range(5)}

    store = RunStore(fresh(storage), name)
    assert [e.dir_name for e in store.all_checkpoints(head)] == names
    result = TrainResult.from_path(storage.path, name, storage_options=storage.options)
    assert [c.path.rsplit("/", 1)[1] for c, _ in result.best_checkpoints] == names
    assert [m["step"] for _, m in result.best_checkpoints] == list(range(1, n + 1))
    scored = TrainResult.from_path(
        storage.path,
        name,
        storage_options=storage.options,
        checkpoint_config=CheckpointConfig(
            checkpoint_score_attribute="step", checkpoint_score_order="min"
        ),
    )
    assert scored.best_checkpoints[-1][0].path.endswith(names[0])  # sealed, and the best

    # A crash leftover next to 45 committed checkpoints, 40 of them only in sealed chunks.
    orphan = checkpoint_dir_name(46, 1, ATTEMPT_1)
    storage_.write_atomic(f"{name}/{orphan}/w.pt", b"lost")
    assert manager.collect_orphans(load(storage, name)) == [orphan]
    assert stored_names(storage, name) == set(names) | {STATE_FILE, INDEX_DIR}
    assert restore(storage, name, names[0], tmp_path) == {"w.pt": b"w"}


@pytest.mark.parametrize("crash_at", [2, 3, 4, None])
def test_crash_between_sealing_a_chunk_and_the_head_leaves_a_consistent_run(
    storage, tmp_path, crash_at
):
    """The save that overflows the head writes: the rank's file (call 1), the manifest (2), the
    sealed chunk (3), the head (4). A crash at 2, 3 or 4 leaves the previous head, which does not
    count the chunk; the rerun's next commit seals the same entries under the same chunk name."""
    name, chunk = f"seal-crash-{crash_at}", 4
    cfg = CheckpointConfig()
    storage_ = fresh(storage)
    state = RunState(name=name)
    manager = CheckpointManager(storage_, RunStore(storage_, name), cfg, index_chunk=chunk)
    names = [commit_tiny(storage_, manager, state, i) for i in range(1, chunk + 1)]

    faulty = FaultyStorage(storage.path, storage.options, crash_at=crash_at)
    crashing = CheckpointManager(faulty, RunStore(faulty, name), cfg, index_chunk=chunk)
    try:
        fifth = commit_tiny(faulty, crashing, state, chunk + 1)
        assert crash_at is None
    except Crash:
        assert crash_at is not None
    if crash_at is None:
        assert faulty.log[1:] == [
            ("write", f"{name}/{fifth}/{MANIFEST}"),
            ("write", f"{name}/{INDEX_DIR}/000000.json"),  # the chunk, before the head
            ("write", f"{name}/{STATE_FILE}"),  # the commit point
        ]
        names.append(fifth)

    after = load(storage, name)
    assert after.latest == names[-1]
    assert after.sealed_chunks == (1 if crash_at is None else 0)
    assert [e.dir_name for e in RunStore(fresh(storage), name).all_checkpoints(after)] == names
    assert chunk_names(storage, name) == ({"000000.json"} if crash_at in (4, None) else set())

    # The rerun: resumes from what storage holds, commits, and collects the crash leftovers.
    rerun = CheckpointManager(
        fresh(storage), RunStore(fresh(storage), name), cfg, index_chunk=chunk
    )
    names.append(commit_tiny(fresh(storage), rerun, after, after.report_index + 1, 1, ATTEMPT_1))
    resumed = load(storage, name)
    assert resumed.sealed_chunks == 1
    assert [e.dir_name for e in RunStore(fresh(storage), name).all_checkpoints(resumed)] == names
    assert rerun.collect_orphans(resumed) == (
        [] if crash_at is None else [checkpoint_dir_name(chunk + 1, 0, ATTEMPT_0)]
    )
    assert stored_names(storage, name) == set(names) | {STATE_FILE, INDEX_DIR}


def test_retention_with_num_to_keep_never_seals(storage):
    name = "keep-2-no-seal"
    cfg = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc")
    storage_ = fresh(storage)
    state = RunState(name=name)
    manager = CheckpointManager(storage_, RunStore(storage_, name), cfg, index_chunk=1)
    names = []
    for i, acc in enumerate([0.5, 0.9, 0.1, 0.7, 0.2, 0.3], start=1):
        dir_name = checkpoint_dir_name(i, 0, ATTEMPT_0)
        storage_.write_atomic(f"{name}/{dir_name}/w.pt", b"w")
        manager.commit(state, dir_name, i, {"acc": acc}, {"w.pt": {"size": 1, "sha256": ""}}, 0)
        names.append(dir_name)
    saved = load(storage, name)
    assert saved.sealed_chunks == 0 and INDEX_DIR not in stored_names(storage, name)
    kept = {names[1], names[3], names[5]}  # the best two (0.9, 0.7), and the latest
    assert {e.dir_name for e in saved.checkpoints} == kept
    assert stored_names(storage, name) == kept | {STATE_FILE}


# -- crash leftovers, damage, and refusal ----------------------------------------------------------


def test_collect_orphans_removes_uncommitted_directories_only(storage, tmp_path):
    name = "orphans"
    cfg = CheckpointConfig()
    storage_ = fresh(storage)
    state = RunState(name=name)
    RunStore(storage_, name).save(state)
    committed, _ = save(storage_, name, state, cfg, 1, rank_files("c1"), tmp_path)
    # Leftovers of a crashed attempt: uploads without a manifest...
    msgs = report_round(storage_, name, 2, rank_files("lost"), {}, 1, ATTEMPT_1, tmp_path)
    uploaded_only = msgs[0].dir_name
    # ...and a manifest written by a driver that died before the run state referenced it.
    with_manifest = checkpoint_dir_name(2, 2, "77" * 16)
    storage_.write_atomic(f"{name}/{with_manifest}/{MANIFEST}", b"{}")
    storage_.write_atomic(f"{name}/notes/readme.txt", b"not a checkpoint")  # not ours: left alone

    manager = CheckpointManager(storage_, RunStore(storage_, name), cfg)
    assert sorted(manager.collect_orphans(load(storage, name))) == sorted(
        [uploaded_only, with_manifest]
    )
    assert stored_names(storage, name) == {STATE_FILE, committed, "notes"}
    assert restore(storage, name, committed, tmp_path) == merged(rank_files("c1"))
    assert manager.collect_orphans(load(storage, name)) == []


def _committed_single(target, name, tmp_path) -> tuple[Storage, str]:
    storage_ = fresh(target)
    state = RunState(name=name)
    dir_name, _ = save(storage_, name, state, CheckpointConfig(), 1, rank_files("ok"), tmp_path)
    return storage_, dir_name


@pytest.mark.parametrize("damage", ["same_size", "other_size", "missing"])
def test_damaged_checkpoint_file_fails_verification(storage, tmp_path, damage):
    name = f"damaged-{damage}"
    storage_, dir_name = _committed_single(storage, name, tmp_path)
    original = restore(storage, name, dir_name, tmp_path)["model.pt"]
    target = f"{name}/{dir_name}/model.pt"
    if damage == "same_size":
        storage_.write_atomic(
            target,
            bytes(reversed(original)) if original != original[::-1] else b"X" * len(original),
        )
    elif damage == "other_size":
        storage_.write_atomic(target, original + b"tail")
    else:
        storage_.fs.rm(storage_.full(target))
    with pytest.raises(StorageError, match="model.pt"):
        restore(storage, name, dir_name, tmp_path)


def test_restore_through_as_directory_verifies_the_manifest(storage, tmp_path, request):
    """What a rank does on resume: get_checkpoint().as_directory(). A damaged file must not be
    handed to the training function."""
    name = "damaged-as-directory"
    storage_, dir_name = _committed_single(storage, name, tmp_path)
    storage_.write_atomic(f"{name}/{dir_name}/model.pt", b"X" * len(b"model ok"))
    ckpt = Checkpoint(storage_.uri(f"{name}/{dir_name}"), storage.options)
    with pytest.raises(StorageError, match="model.pt"):
        with ckpt.as_directory():
            pass


def test_torn_run_state_gives_a_clear_storage_error(storage, tmp_path):
    name = "torn"
    storage_ = fresh(storage)
    whole = RunState(name=name).model_dump_json().encode()
    storage_.write_atomic(f"{name}/{STATE_FILE}", whole[: len(whole) // 2])
    with pytest.raises(StorageError, match="not valid JSON") as err:
        RunStore(fresh(storage), name).load()
    assert STATE_FILE in str(err.value) and "run_config.name" in str(err.value)
    with pytest.raises(StorageError, match="not valid JSON"):  # the driver refuses too
        prepare.prepare_run(
            NOOP,
            {},
            ScalingConfig(),
            RunConfig(name=name, storage_path=storage.path, storage_options=storage.options),
            log=lambda msg: None,
        )
    storage_.write_atomic(f"{name}/{STATE_FILE}", b'{"schema_version": 1, "checkpoints": 3}')
    with pytest.raises(StorageError, match="is not a run state"):
        RunStore(fresh(storage), name).load()


def test_run_state_from_a_newer_schema_is_refused_and_left_untouched(storage, tmp_path):
    name = "future"
    storage_ = fresh(storage)
    doc = json.loads(RunState(name=name).model_dump_json())
    doc["schema_version"] = SCHEMA_VERSION + 1
    raw = json.dumps(doc).encode()
    storage_.write_atomic(f"{name}/{STATE_FILE}", raw)
    with pytest.raises(StorageError, match="upgrade ft-train"):
        RunStore(fresh(storage), name).load()
    with pytest.raises(StorageError, match=f"schema_version {SCHEMA_VERSION + 1}"):
        prepare.prepare_run(
            NOOP,
            {},
            ScalingConfig(),
            RunConfig(name=name, storage_path=storage.path, storage_options=storage.options),
            log=lambda msg: None,
        )
    assert fresh(storage).read_bytes(f"{name}/{STATE_FILE}") == raw  # not overwritten
