"""A node's disk stays flat however often its ranks restore: the checkpoint download cache
(`download_cache`, behind `Checkpoint.as_directory`), the staging directories of
`ft_train.staging_dir` and of asynchronous uploads (`uploads`), and the directories of the
snapshot rounds ranks restored (`snapshots`) are evicted, a killed rank's included.

Remote checkpoints live on fsspec's `memory://` (in-process, so `as_directory` takes the download
path without Dask), and on the loopback S3 endpoint where another process must see them. The
node's temporary directory is the test's, so every byte counted is ft-train's.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from pathlib import Path

import fsspec
import pytest

import ft_train
from ft_train import knobs
from ft_train.config import CheckpointConfig
from ft_train.snapshots import piece_files
from ft_train.snapshots.format import pack
from ft_train.snapshots.piece import SnapshotPiece, SnapshotRound
from ft_train.snapshots.rank import RESTORED, RankSnapshots
from ft_train.storage.checkpoint import Checkpoint
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore
from ft_train.worker import download_cache
from ft_train.worker.session import Session
from ft_train.worker.uploads import STAGING
from tests.conftest import make_s3_target
from tests.helpers import run_killed
from tests.write_path import commit_round, rank_spec, write_tree

FILE_BYTES = 4096  # two files a checkpoint: 8 KiB


@pytest.fixture
def node(tmp_path, monkeypatch) -> Path:
    """The node's temporary directory, where the cache and the staging directories go."""
    tmp = tmp_path / "node"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture
def remote():
    url = f"memory://ft-disk-{uuid.uuid4().hex[:8]}"
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def disk_bytes(root: Path) -> int:
    """Bytes of the files under `root`, each inode once (a snapshot hard-links its files)."""
    seen: dict[int, int] = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except FileNotFoundError:
                continue  # an upload finished meanwhile and removed its snapshot
            seen[st.st_ino] = st.st_size
    return sum(seen.values())


def checkpoint_files(tag: str) -> dict[str, bytes]:
    return {
        "model.pt": tag.encode().ljust(FILE_BYTES, b"m"),
        "optim.pt": tag.encode().ljust(FILE_BYTES, b"o"),
    }


def cache_entries(node: Path) -> set[str]:
    cache = node / download_cache.CACHE
    return {n.split(".", 1)[0] for n in os.listdir(cache)} if cache.exists() else set()


def commit_plain(storage: Storage, name: str, n: int, tmp: Path) -> list[Checkpoint]:
    """`n` committed checkpoints (uploaded, then committed by the driver's manager)."""
    state, out = RunState(name=name), []
    manager = CheckpointManager(storage, RunStore(storage, name), CheckpointConfig())
    for i in range(1, n + 1):
        dir_name = checkpoint_dir_name(i, 0, "0a" * 16)
        local = write_tree(tmp / f"src-{name}-{i}", checkpoint_files(f"{name}-{i}"))
        files = storage.upload_dir(local, f"{name}/{dir_name}")
        manager.commit(state, dir_name, i, {}, files, 0)
        out.append(Checkpoint(storage.uri(f"{name}/{dir_name}"), storage.options))
    return out


def read_dir(d: str) -> dict[str, bytes]:
    return {n: Path(d, n).read_bytes() for n in ("model.pt", "optim.pt")}


# -- hundreds of restores -------------------------------------------------------------------------


def attempt(
    storage: Storage,
    manager: CheckpointManager,
    state: RunState,
    number: int,
    peaks: dict[str, int],
    node: Path,
) -> None:
    """One attempt of a one-rank run: restore the latest checkpoint, then save the next in a
    `staging_dir` and report it with an asynchronous upload; the driver commits it."""
    spec = rank_spec(storage, state.name, 0, 1, number, f"{number:032x}", state.report_index)
    spec.checkpoint_dir = state.latest
    msgs: list[dict] = []
    session = Session(spec, send=msgs.append)
    if (restored := session.checkpoint()) is not None:
        with restored.as_directory() as d:
            assert read_dir(d) == checkpoint_files(f"attempt {number - 1}")
            peaks["cache"] = max(peaks["cache"], disk_bytes(node / download_cache.CACHE))
    with ft_train.staging_dir() as d:
        write_tree(d, checkpoint_files(f"attempt {number}"))
        session.report(
            {"step": number},
            checkpoint=Checkpoint.from_directory(d),
            checkpoint_upload_mode="async",
        )
        peaks["staging"] = max(peaks["staging"], disk_bytes(node / STAGING))
    session.finish()  # the rank returns: its uploads are done
    session.close()
    commit_round(manager, state, msgs, state.report_index + 1, number)


def test_disk_stays_flat_over_hundreds_of_restores(node, remote):
    storage, name, restores = Storage(remote), "restores", 250
    state = RunState(name=name)
    store = RunStore(storage, name)
    store.save(state)
    manager = CheckpointManager(storage, store, CheckpointConfig(num_to_keep=1))
    peaks = {"cache": 0, "staging": 0}
    for number in range(restores + 1):  # the first attempt starts from scratch
        attempt(storage, manager, state, number, peaks, node)
        assert len(cache_entries(node)) <= knobs.DOWNLOAD_CACHE_KEEP
        assert disk_bytes(node / STAGING) == 0  # every snapshot and staging directory went

    entry = 2 * FILE_BYTES + 1024  # a checkpoint's files and its manifest
    downloaded = restores * 2 * FILE_BYTES  # what the cache held before it was evicted
    print(
        f"\n{restores} restores: {downloaded} bytes downloaded; peak {peaks['cache']} bytes "
        f"in the cache, {peaks['staging']} in staging"
    )
    assert peaks["cache"] <= knobs.DOWNLOAD_CACHE_KEEP * entry
    assert peaks["staging"] <= 2 * FILE_BYTES  # one checkpoint, its snapshot hard-linked
    assert disk_bytes(node / download_cache.CACHE) <= knobs.DOWNLOAD_CACHE_KEEP * entry


# -- what eviction must never remove, and what it must ---------------------------------------------


def test_an_entry_in_use_survives_eviction(node, remote, tmp_path):
    storage = Storage(remote)
    target, *others = commit_plain(storage, "in-use", knobs.DOWNLOAD_CACHE_KEEP + 3, tmp_path)
    with target.as_directory() as d:
        for (
            ckpt
        ) in others:  # each download evicts what is past DOWNLOAD_CACHE_KEEP, but not what is open
            with ckpt.as_directory():
                pass
        assert read_dir(d) == checkpoint_files("in-use-1")
    assert download_cache.key_of(target.path) in cache_entries(node)
    with others[0].as_directory():  # closed now: the next download evicts it
        pass
    assert download_cache.key_of(target.path) not in cache_entries(node)
    assert len(cache_entries(node)) == knobs.DOWNLOAD_CACHE_KEEP


def test_two_ranks_restoring_one_checkpoint_at_once_share_it(node, remote, tmp_path):
    """Each rank waits inside its block for the other (as a collective in the training function
    would): a rank that waited for the other to leave its block before downloading would hang.
    Many rounds, so that the second rank often looks before the first has the directory."""
    ckpts = commit_plain(Storage(remote), "pair", 20, tmp_path)
    for i, ckpt in enumerate(ckpts, 1):
        inside = threading.Barrier(2, timeout=30)
        seen: dict[int, tuple[str, dict]] = {}

        def rank(r: int) -> None:
            with ckpt.as_directory() as d:
                inside.wait()
                seen[r] = (d, read_dir(d))

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen[0] == seen[1] and seen[0][1] == checkpoint_files(f"pair-{i}"), f"round {i}"
        assert len(cache_entries(node)) <= knobs.DOWNLOAD_CACHE_KEEP


# A rank process on the node, killed (SIGKILL) while one thread has checkpoint 1 open and another
# is halfway through downloading checkpoint 2, and with a checkpoint half written in its
# staging_dir: it leaves a complete cache entry, a partial one, and a staging directory.
KILLED_RANK = """
import json, os, signal, sys, tempfile, threading
from pathlib import Path
import ft_train
from ft_train.storage.checkpoint import Checkpoint
a = json.loads(sys.argv[1])
tempfile.tempdir = a["node"]
staging = ft_train.staging_dir()  # held until the kill: never closed
Path(staging.__enter__(), "model.pt").write_bytes(b"s" * 4096)
opened, half = threading.Event(), threading.Event()

def reader():
    with Checkpoint(a["urls"][0], a["options"]).as_directory():
        opened.set()
        threading.Event().wait()

def torn_download(local_dir):
    os.makedirs(local_dir)
    Path(local_dir, "model.pt").write_bytes(b"half a download")
    half.set()
    threading.Event().wait()

threading.Thread(target=reader, daemon=True).start()
downloading = Checkpoint(a["urls"][1], a["options"])
downloading.download_verified = torn_download
threading.Thread(target=lambda: downloading.as_directory().__enter__(), daemon=True).start()
assert opened.wait(60) and half.wait(60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_ranks_cache_entries_and_staging_are_evicted(node, s3_endpoint, tmp_path):
    target = make_s3_target(s3_endpoint)
    storage = Storage(target.path, target.options)
    ckpts = commit_plain(storage, "killed", knobs.DOWNLOAD_CACHE_KEEP + 3, tmp_path)
    args = dict(node=str(node), urls=[c.path for c in ckpts[:2]], options=target.options)
    run_killed(KILLED_RANK, args)
    cache = node / download_cache.CACHE
    left = {download_cache.key_of(c.path) for c in ckpts[:2]}
    assert left <= cache_entries(node)
    assert any(".partial-" in n for n in os.listdir(cache))  # the torn download
    assert disk_bytes(node / STAGING) == 4096

    for i, ckpt in enumerate(ckpts[2:], 3):  # the node's next restores evict the dead rank's
        with ckpt.as_directory() as d:
            assert read_dir(d) == checkpoint_files(f"killed-{i}")
    assert not left & cache_entries(node), os.listdir(cache)
    assert not any(".partial-" in n for n in os.listdir(cache))
    assert len(cache_entries(node)) == knobs.DOWNLOAD_CACHE_KEEP
    assert disk_bytes(cache) <= knobs.DOWNLOAD_CACHE_KEEP * (2 * FILE_BYTES + 1024)
    with ft_train.staging_dir():  # the node's next staging sweeps the dead process's
        assert disk_bytes(node / STAGING) == 0


# A rank process that restored a snapshot round (its piece read from the holder's file on this
# host) and is killed (SIGKILL) while the round's directory is in use: it never removes it.
KILLED_RESTORING_RANK = """
import json, os, signal, sys, tempfile
from ft_train.snapshots.piece import SnapshotPiece, SnapshotRound
from ft_train.snapshots.rank import RankSnapshots
a = json.loads(sys.argv[1])
tempfile.tempdir = a["node"]
snapshots = RankSnapshots("run", a["attempt"], 0, 1, [], 1)  # never closed
piece = SnapshotPiece(**a["piece"])
with snapshots.restored(SnapshotRound("a0", 26, "snapshot", (piece,))).as_directory() as d:
    print(sorted(os.listdir(d)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_ranks_restored_snapshot_is_removed_by_the_next_restore(node):
    blob = pack(lambda d: Path(d, "model.pt").write_bytes(b"r" * FILE_BYTES))
    if (path := piece_files.write(blob)) is None:
        pytest.skip("no writable /dev/shm: without a holder's file a restore needs Dask")
    piece = SnapshotPiece("a0", 0, 26, "snapshot", 1, len(blob), "tcp://127.0.0.1:9", path)
    round_26 = SnapshotRound("a0", 26, "snapshot", (piece,))
    try:
        for attempt in ("a1", "a2", "a3"):  # a rank killed with its restored round open, 3 times
            args = dict(node=str(node), attempt=attempt, piece=piece.to_dict())
            proc = run_killed(KILLED_RESTORING_RANK, args)
            assert proc.stdout.strip() == "['model.pt']", proc.stdout + proc.stderr
            # each restore swept the round its killed predecessor left: only the last one's is left
            assert disk_bytes(node) == FILE_BYTES, sorted(os.listdir(node))

        snapshots = RankSnapshots("run", "a4", 0, 1, [], 1)  # the node's next rank
        with snapshots.restored(round_26).as_directory() as d:
            assert Path(d, "model.pt").read_bytes() == b"r" * FILE_BYTES
            assert disk_bytes(node) == FILE_BYTES  # its own round only
        snapshots.close()
        assert disk_bytes(node) == 0 and os.listdir(node) == [RESTORED]
    finally:
        piece_files.unlink(path)
