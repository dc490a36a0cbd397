"""Files of the same name from several ranks in one round (DESIGN.md, storage invariant 3),
without a cluster: the ranks' uploads (`Storage.upload_dir(rank=...)`) in every order, the
round's choice of the lowest rank's file (`controller.rounds`), and the commit that moves it into
place (`CheckpointManager.commit`). Local disk and fsspec's `memory://` (a store without an
exclusive create); S3's conditional PUT is covered end to end in tests/test_same_named_files.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import fsspec
import pytest

from ft_train.config import CheckpointConfig
from ft_train.controller.rounds import ReportRounds, collision_warning
from ft_train.protocol import Report
from ft_train.storage.checkpoint import MANIFEST, Checkpoint
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.fs import DUPLICATES, Storage, local_files, side_path
from ft_train.storage.run_state import RunState, RunStore

DIR = "checkpoint_000001-a0-0a0a0a0a"


def info(data: bytes, **extra) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **extra}


def round_of(files_by_rank: dict[int, dict | None], world: int):
    """The round that `ReportRounds` makes of each rank's first report (None: no checkpoint)."""
    rounds = ReportRounds(world_size=world, last_index=0)
    for rank in range(world):
        files = files_by_rank.get(rank)
        rounds.add(Report(rank, 1, {"rank": rank}, DIR if files is not None else None, files or {}))
    rnd = rounds.pop_complete()
    assert rnd is not None
    return rnd


# -- the round's choice ----------------------------------------------------------------------------


def test_the_lowest_ranks_file_of_a_name_is_the_rounds_whatever_arrived_first():
    a, b, c = b"rank 0", b"rank 1", b"rank 2"
    rnd = round_of(
        {
            2: {"state.pt": info(c), "__2_0.distcp": info(c)},  # rank 2 created state.pt first
            0: {"state.pt": info(a, at=side_path(0, "state.pt")), "__0_0.distcp": info(a)},
            1: {"state.pt": info(b, at=side_path(1, "state.pt"))},
        },
        world=3,
    )
    assert rnd.files["state.pt"] == info(a, at=".ft-dup/rank-0/state.pt", ranks=[0, 1, 2])
    assert rnd.files["__0_0.distcp"] == info(a) and rnd.files["__2_0.distcp"] == info(c)
    warning = collision_warning(rnd)
    assert warning is not None and "'state.pt' by ranks 0, 1, 2" in warning
    assert "distcp" not in warning and "lowest rank's file is kept" in warning


def test_a_round_without_shared_names_is_taken_as_sent():
    """The common case: no entry changes, no warning (sharded files, or rank 0 alone saves)."""
    shards = {0: {"__0_0.distcp": info(b"0")}, 1: {"__1_0.distcp": info(b"1")}}
    rnd = round_of(shards, world=2)
    assert rnd.files == {**shards[0], **shards[1]}
    assert collision_warning(rnd) is None
    alone = round_of({0: {"state.pt": info(b"0")}, 1: None}, world=2)
    assert alone.files == {"state.pt": info(b"0")} and collision_warning(alone) is None


def test_without_rank_0s_file_the_next_lowest_rank_wins():
    rnd = round_of({0: None, 1: {"s": info(b"1", at=side_path(1, "s"))}, 2: {"s": info(b"2")}}, 3)
    assert rnd.files["s"] == info(b"1", at=".ft-dup/rank-1/s", ranks=[1, 2])


# -- uploads and the commit, on storage ------------------------------------------------------------


class CountingStorage(Storage):
    """A real Storage that counts the driver's commit-time calls."""

    def __init__(self, url):
        super().__init__(url)
        self.moves, self.deletes = [], []

    def move_file(self, src, dst):
        self.moves.append(src)
        return super().move_file(src, dst)

    def delete_dir(self, path):
        self.deletes.append(path)
        return super().delete_dir(path)


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        yield CountingStorage(str(tmp_path / "runs"))
        return
    root = f"memory://ft-collide-{uuid.uuid4().hex[:8]}"
    yield CountingStorage(root)
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def rank_dir(tmp_path, rank: int, files: dict[str, bytes]) -> str:
    d = tmp_path / f"rank-{rank}-{uuid.uuid4().hex[:6]}"
    for rel, data in files.items():
        os.makedirs(os.path.dirname(d / rel), exist_ok=True)
        (d / rel).write_bytes(data)
    return str(d)


def save_round(storage, tmp_path, files_by_rank: dict[int, dict[str, bytes]], order, world=None):
    """Each rank of `order` uploads its files, in that order; the driver commits the round.
    Returns the committed checkpoint and the round's files as committed."""
    name = "run"
    msgs = {}
    for rank in order:
        local = rank_dir(tmp_path, rank, files_by_rank[rank])
        msgs[rank] = storage.upload_dir(local, f"{name}/{DIR}", rank=rank)
    world = world or max(files_by_rank) + 1
    rnd = round_of({r: msgs.get(r) for r in range(world)}, world)
    manager = CheckpointManager(storage, RunStore(storage, name), CheckpointConfig())
    manager.commit(RunState(name=name), rnd.dir_name, rnd.index, rnd.metrics, rnd.files, 0)
    return Checkpoint(storage.uri(f"{name}/{DIR}")), msgs


def restored(checkpoint: Checkpoint, tmp_path) -> dict[str, bytes]:
    out = tmp_path / f"restored-{uuid.uuid4().hex[:6]}"
    checkpoint.download_verified(str(out))  # raises CheckpointDamagedError on a mismatch
    return {rel: (out / rel).read_bytes() for rel in local_files(str(out)) if rel != MANIFEST}


ORDERS = [(0, 1, 2), (2, 1, 0), (1, 2, 0), (2, 0, 1)]


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join(map(str, o)))
def test_every_upload_order_commits_rank_0s_bytes_and_a_manifest_that_matches(
    storage, tmp_path, order
):
    files = {r: {"state.pt": f"rank {r} ".encode() * (r + 1), f"own-{r}.pt": b"x"} for r in order}
    checkpoint, msgs = save_round(storage, tmp_path, files, order)
    got = restored(checkpoint, tmp_path)
    assert got["state.pt"] == files[0]["state.pt"], order
    assert {f"own-{r}.pt" for r in order} <= set(got)
    manifest = json.loads(storage.read_bytes(f"run/{DIR}/{MANIFEST}"))
    assert manifest["files"]["state.pt"] == info(files[0]["state.pt"])  # no "at", no "ranks"
    assert DUPLICATES not in storage.list_dir(f"run/{DIR}")
    # a rank's report says where its bytes went: in place, or at its side path
    placed = [r for r in order if "at" not in msgs[r]["state.pt"]]
    assert len(placed) >= 1 and all(
        msgs[r]["state.pt"].get("at") == side_path(r, "state.pt") for r in order if r not in placed
    )
    assert storage.deletes == [f"run/{DIR}/{DUPLICATES}"]


@pytest.mark.parametrize("order", [(1, 2), (2, 1)], ids=["1-2", "2-1"])
def test_without_rank_0_the_lowest_rank_that_saved_wins(storage, tmp_path, order):
    files = {r: {"sub/state.pt": f"rank {r}".encode()} for r in order}
    checkpoint, msgs = save_round(storage, tmp_path, {0: {"w.pt": b"w"}, **files}, (0, *order))
    assert restored(checkpoint, tmp_path)["sub/state.pt"] == b"rank 1"
    # rank 2 first: rank 1's bytes were at its side path and were moved into place
    assert storage.moves == ([f"run/{DIR}/.ft-dup/rank-1/sub/state.pt"] if order[0] == 2 else [])


def test_distinct_names_cost_no_commit_time_call_and_no_side_path(storage, tmp_path):
    shards = {r: {f"__{r}_0.distcp": bytes([r]) * 10} for r in range(3)}
    checkpoint, msgs = save_round(storage, tmp_path, shards, (2, 0, 1))
    assert all("at" not in i for m in msgs.values() for i in m.values())
    assert storage.moves == [] and storage.deletes == []
    assert restored(checkpoint, tmp_path) == {n: d for s in shards.values() for n, d in s.items()}
    assert sorted(storage.list_dir(f"run/{DIR}")) == sorted(
        [MANIFEST, *restored(checkpoint, tmp_path)]
    )
