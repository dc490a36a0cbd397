"""The storage write path driven without Dask, for the storage tests: ranks are `Session`s whose
messages are collected with `send=list.append`, consolidated by the controller's `ReportRounds`
and committed by `CheckpointManager`; `FaultyStorage` crashes it at a chosen call; and what a
rerun sees, read through a fresh `Storage`.

`noop_train_loop` is the importable train_loop these runs name
(`tests.write_path:noop_train_loop`): `prepare_run` checks it imports; nothing calls it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ft_train.config import CheckpointConfig
from ft_train.controller.rounds import ReportRounds
from ft_train.protocol import RankSpec
from ft_train.storage.checkpoint import MANIFEST, Checkpoint
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.fs import Storage, local_files
from ft_train.storage.run_state import RunState, RunStore
from ft_train.worker.session import Session
from tests.helpers import fresh
from tests.rank_specs import rank_spec as a_rank_spec

NOOP = "tests.write_path:noop_train_loop"
ATTEMPT_0 = "0a" * 16  # attempt ids are uuid4 hex strings
ATTEMPT_1 = "1b" * 16


def noop_train_loop(config: dict) -> None:
    """An importable train_loop for `prepare_run`; never called."""


# -- fault injection ------------------------------------------------------------------------------


class Crash(Exception):
    """A simulated crash of the process that made the storage call."""


class FaultyStorage(Storage):
    """A real Storage that logs its mutating calls as (op, path) and raises `Crash` in place of the
    `crash_at`-th one (1-based). With `torn=True` a crashing `upload_dir` first uploads half of its
    files, like a process killed mid-upload. `on_delete(path)` runs just before each delete."""

    def __init__(self, url, options=None, crash_at=None, torn=False, on_delete=None):
        super().__init__(url, options)
        self.crash_at, self.torn, self.on_delete = crash_at, torn, on_delete
        self.log: list[tuple[str, str]] = []
        self.calls = 0

    def _crashes_now(self) -> bool:
        self.calls += 1
        return self.calls == self.crash_at

    def write_atomic(self, path: str, data: bytes) -> None:
        if self._crashes_now():
            raise Crash(f"write {path}")
        super().write_atomic(path, data)
        self.log.append(("write", path))

    def upload_dir(self, local_dir: str, path: str, should_stop=None, rank: int = 0):
        if self._crashes_now():
            if self.torn:
                rels = local_files(local_dir)
                with tempfile.TemporaryDirectory() as part:
                    for rel in rels[: max(1, len(rels) // 2)]:
                        shutil.copy(os.path.join(local_dir, rel), os.path.join(part, rel))
                    super().upload_dir(part, path, should_stop, rank)
            raise Crash(f"upload {path}")
        infos = super().upload_dir(local_dir, path, should_stop, rank)
        self.log.append(("upload", path))
        return infos

    def delete_dir(self, path: str) -> None:
        if self._crashes_now():
            raise Crash(f"delete {path}")
        if self.on_delete is not None:
            self.on_delete(path)
        super().delete_dir(path)
        self.log.append(("delete", path))


# -- the write path, driven without Dask -----------------------------------------------------------


def write_tree(root, files: dict[str, bytes]) -> str:
    os.makedirs(root, exist_ok=True)
    for rel, data in files.items():
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    return str(root)


def rank_spec(
    storage: Storage,
    name: str,
    rank: int,
    world: int,
    attempt: int,
    attempt_id: str,
    start_index: int,
) -> RankSpec:
    return a_rank_spec(
        storage,
        rank,
        world,
        train_loop=noop_train_loop,
        name=name,
        attempt=attempt,
        attempt_id=attempt_id,
        start_report_index=start_index,
        collective_timeout_s=1800.0,
    )


def report_round(
    storage: Storage,
    name: str,
    index: int,
    files_by_rank: list[dict[str, bytes]],
    metrics: dict,
    attempt: int,
    attempt_id: str,
    tmp_path,
) -> list[dict]:
    """Every rank's `index`-th report(), each rank attaching its own files; returns the messages."""
    msgs: list[dict] = []
    for rank, files in enumerate(files_by_rank):
        session = Session(
            rank_spec(storage, name, rank, len(files_by_rank), attempt, attempt_id, index - 1),
            send=msgs.append,
        )
        local = write_tree(tmp_path / f"local-{name}-{index}-{attempt_id[:4]}-{rank}", files)
        session.report(metrics, checkpoint=Checkpoint.from_directory(local))
        shutil.rmtree(local)  # report() has uploaded; the local copy may go
    return msgs


def commit_round(
    manager: CheckpointManager, state: RunState, msgs: list[dict], index: int, attempt: int
) -> tuple[str, list[str]]:
    rounds = ReportRounds(world_size=len(msgs), last_index=index - 1)
    for m in msgs:
        rounds.add(m)
    rnd = rounds.pop_complete()
    assert rnd is not None and rnd.index == index
    dropped = manager.commit(state, rnd.dir_name, rnd.index, rnd.metrics, rnd.files, attempt)
    return rnd.dir_name, dropped


def save(
    storage: Storage,
    name: str,
    state: RunState,
    cfg: CheckpointConfig,
    index: int,
    files_by_rank: list[dict[str, bytes]],
    tmp_path,
    metrics: dict | None = None,
    attempt: int = 0,
    attempt_id: str = ATTEMPT_0,
) -> tuple[str, list[str]]:
    """One checkpoint save: every rank uploads, then the driver commits."""
    metrics = metrics if metrics is not None else {"step": index}
    msgs = report_round(storage, name, index, files_by_rank, metrics, attempt, attempt_id, tmp_path)
    manager = CheckpointManager(storage, RunStore(storage, name), cfg)
    return commit_round(manager, state, msgs, index, attempt)


def rank_files(tag: str) -> list[dict[str, bytes]]:
    """Two ranks, two files each (so a torn upload leaves some files), contents tagged."""
    return [
        {"model.pt": f"model {tag}".encode(), "optim.pt": f"optim {tag}".encode() * 3},
        {"rng_1.pt": f"rng1 {tag}".encode(), "data_1.pt": f"data1 {tag}".encode() * 5},
    ]


def merged(files_by_rank: list[dict[str, bytes]]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for files in files_by_rank:
        out.update(files)
    return out


# -- what a rerun sees -----------------------------------------------------------------------------


def load(target, name: str) -> RunState | None:
    return RunStore(fresh(target), name).load()


def restore(target, name: str, dir_name: str, tmp_path) -> dict[str, bytes]:
    """Download a checkpoint through its manifest, verified; return its files' contents."""
    ckpt = Checkpoint(fresh(target).uri(f"{name}/{dir_name}"), target.options)
    local = tempfile.mkdtemp(dir=tmp_path, prefix="restore-")
    ckpt.download_verified(local)
    out = {}
    for rel in local_files(local):
        if rel != MANIFEST:
            with open(os.path.join(local, rel), "rb") as f:
                out[rel] = f.read()
    return out


def stored_names(target, name: str) -> set[str]:
    return set(fresh(target).list_dir(name))


def stored_files(target, path: str) -> set[str]:
    """Every file under `path` (recursively), relative to it, read with a fresh listing."""
    storage = fresh(target)
    storage.fs.invalidate_cache()
    root = storage.full(path).rstrip("/")
    return {p[len(root) + 1 :] for p in storage.fs.find(root)}


def assert_references_restorable(target, name: str, state: RunState, tmp_path) -> None:
    """Every checkpoint the run state references exists and verifies against its manifest."""
    for entry in state.checkpoints:
        restore(target, name, entry.dir_name, tmp_path)
    assert state.latest is None or state.latest in {e.dir_name for e in state.checkpoints}


def committed_run(target, name: str, tmp_path, cfg: CheckpointConfig) -> tuple[RunState, str]:
    """A run with one committed checkpoint (index 1, contents tagged 'old')."""
    storage = fresh(target)
    state = RunState(name=name)
    RunStore(storage, name).save(state)
    dir_name, _ = save(storage, name, state, cfg, 1, rank_files("old"), tmp_path)
    return state, dir_name
