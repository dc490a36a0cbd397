"""The in-memory snapshot tier (`ft_train.snapshots`) and the just-in-time save.

A rank's snapshot pieces are held by its own nanny and a peer worker's. On a local cluster the
nannies run in the driver's process, which is this test's: a test reads (and damages) what they
hold through `snapshot_store.STORES`, as a measurement or a bit flip in their memory would.
Losing a holder takes a cluster whose nannies are processes of their own: the chaos test's
external cluster, a `dask scheduler` and nodes of a nanny and its worker, reached by address.

Each fault test runs the loop at a few ms a step and at 50 ms a step, and checks the final
weights bit for bit against a run without faults.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
from dataclasses import replace

import pytest
import torch

import ft_train
from ft_train.errors import CheckpointDamagedError, SessionError
from ft_train.snapshots import format as piece_format
from ft_train.snapshots import holders as snapshot_holders
from ft_train.snapshots import piece_files
from ft_train.snapshots import store as snapshot_store
from ft_train.snapshots.format import pack, whole
from ft_train.snapshots.piece import Kind, SnapshotPiece, SnapshotRound
from ft_train.snapshots.rank import RankSnapshots
from ft_train.snapshots.rounds import SnapshotTier, complete_rounds
from ft_train.worker.journal import run_key
from tests.conftest import StorageTarget
from tests.external_clusters import NannyCluster
from tests.helpers import assert_bit_identical, fresh, load_state, run_config, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")

FAST = "tests.loops:fast_checkpoints"
EVERY = 20  # a checkpoint on storage every 20 reports
SNAP = 2  # a snapshot every 2
STEPS = 48
PACES = [0.0, 0.05]  # seconds of compute a step, beyond the loop's few ms


def train_fast(target, name, config, max_failures=0, snapshot_every=SNAP, **kw):
    from flows.train import train

    return train(
        train_loop=FAST,
        train_loop_config={"steps": STEPS, "every": EVERY, **config},
        scaling_config=ft_train.ScalingConfig(num_workers=kw.pop("workers", 2)),
        run_config=run_config(
            target,
            name,
            max_failures,
            checkpoint_config=ft_train.CheckpointConfig(snapshot_every=snapshot_every),
        ),
        **kw,
    )


def weights(result: ft_train.TrainResult) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "rank0.pt"))["model"]


def kill(rank, step, tmp_path, kind="kill") -> dict:
    return {"rank": rank, "step": step, "kind": kind, "marker": str(tmp_path / f"{kind}-{step}")}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> dict[str, torch.Tensor]:
    target = StorageTarget("local", str(tmp_path_factory.mktemp("fault-free") / "runs"))
    result = train_fast(target, "fault-free", {}, snapshot_every=None)
    assert result.status == "finished" and not result.failures
    return weights(result)


def local(tmp_path) -> StorageTarget:
    return StorageTarget("local", str(tmp_path / "runs"))


@pytest.mark.parametrize("pace", PACES)
def test_a_rank_killed_between_checkpoints_resumes_from_the_newest_snapshot(
    tmp_path, pace, fault_free
):
    # SIGKILL right after report 27: the checkpoint on storage is at 20, snapshots at 22..26.
    # report() 26 returned once the killed rank's piece of 24 was held; 26's may be on its way.
    target, name = local(tmp_path), f"snap-kill-{pace}"
    config = {"snapshot": True, "step_s": pace, "faults": [kill(1, 27, tmp_path)]}
    result = train_fast(target, name, config, max_failures=1)

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("process_death", 1, 27)]
    restart = load_state(target, name).attempts[1]
    assert restart.restored_from is not None and restart.restored_from.startswith(
        "checkpoint_000020-"
    )
    assert restart.start_report_index in (24, 26), restart
    assert restart.restored_snapshot.startswith(f"snapshot {restart.start_report_index} ")
    assert_bit_identical(weights(result), fault_free)


@pytest.mark.parametrize(("pace", "jit"), [*((p, True) for p in PACES), (PACES[0], "files")])
def test_the_survivors_save_just_in_time_when_a_rank_raises(tmp_path, pace, jit, fault_free):
    # No snapshots: rank 1 raises right after report 27; rank 0, in step 28's all-reduce, loses
    # its peer and saves the state of report 27, which the restart resumes from. It saves with
    # save(directory), or from {file: state} (jit="files").
    target, name = local(tmp_path), f"jit-{pace}-{jit}"
    config = {"jit": jit, "step_s": pace, "faults": [kill(1, 27, tmp_path, "raise")]}
    result = train_fast(target, name, config, max_failures=1, snapshot_every=None)

    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("exception", 1, 27)]
    restart = load_state(target, name).attempts[1]
    assert restart.start_report_index == 27, restart
    assert restart.restored_snapshot.startswith("jit 27 "), restart
    assert_bit_identical(weights(result), fault_free)


def held_by_rank(name: str, target) -> dict[int, list]:
    """rank -> the held pieces of run `name` (the local cluster's holders are in this process)."""
    run, out = run_key(fresh(target).uri(name)), {}
    for store in list(snapshot_store.STORES.values()):
        for (r, rank), slot in list(store.pieces.items()):
            if r == run:
                out.setdefault(rank, []).extend(slot)
    return out


def at_gate(tmp_path, rank, step, act) -> tuple[list[dict], threading.Thread]:
    """A gate at (rank, step) and a thread that runs `act()` there, then opens it."""
    marker, path = tmp_path / f"gate-{step}", tmp_path / f"open-{step}"
    gate = {"rank": rank, "step": step, "kind": "until_file", "marker": str(marker)}
    gate["path"] = str(path)

    def run() -> None:
        wait_for(marker.exists, 120, "the gate")
        try:
            act()
        finally:
            path.touch()

    return [gate], threading.Thread(target=run, daemon=True)


def test_a_damaged_snapshot_is_detected_and_the_run_falls_back_to_storage(tmp_path, fault_free):
    target, name = local(tmp_path), "snap-damaged"
    damaged: list = []

    def damage() -> None:  # every copy of rank 0's pieces after the checkpoint at 20: a bit each
        wait_for(
            lambda: [h.piece.index for h in held_by_rank(name, target).get(0, [])].count(26) == 2,
            30,
            "both copies of rank 0's piece of round 26",
        )
        for k, piece in enumerate(held_by_rank(name, target)[0]):
            # on one host, a piece's two copies are one file in /dev/shm: a bit each, apart
            flip_held(piece, piece.blob.nbytes // 2 + k)  # in the state's bytes
            damaged.append((piece.piece.index, piece.path is not None))

    gate, thread = at_gate(tmp_path, 1, 27, damage)
    thread.start()
    config = {"snapshot": "save", "faults": [*gate, kill(1, 28, tmp_path)]}
    result = train_fast(target, name, config, max_failures=1)
    thread.join(10)

    in_files = piece_files.directory() is not None  # a holder on the rank's host links its file
    assert sorted(damaged) == [(24, in_files)] * 2 + [(26, in_files)] * 2
    assert result.status == "finished", result.error
    charged = [(f.kind, f.rank, f.step) for f in result.failures if f.charged]
    assert charged == [("process_death", 1, 28)]
    # rank 0 finds each damaged round it restores from (a CRC-32) and fails; the restart
    # after that passes the round over, not charged
    attempts = load_state(target, name).attempts[1:]
    tried = [a.start_report_index for a in attempts]
    assert tried[-1] in (20, 28), attempts  # storage, or round 28 (sent after the damage)
    assert set(tried[:-1]) <= {24, 26}, attempts
    unusable = [f for f in result.failures if not f.charged]
    assert len(unusable) == len(tried) - 1, result.failures
    assert all("no copy of rank 0's piece is held whole" in f.error for f in unusable)
    last = attempts[-1]
    assert (last.restored_snapshot is None) == (last.start_report_index == 20), last
    assert_bit_identical(weights(result), fault_free)


def test_holders_memory_stays_bounded_over_100_snapshot_rounds(tmp_path):
    target, name = local(tmp_path), "snap-bounded"
    seen: dict = {}

    def measure() -> None:  # (holder, rank) -> the report indexes it holds
        run = run_key(fresh(target).uri(name))
        stores = list(snapshot_store.STORES.items())
        seen["held"] = {(a, r): ix for a, s in stores for r, ix in s.held_pieces(run).items()}
        seen["sizes"] = [p.blob.nbytes for ps in held_by_rank(name, target).values() for p in ps]
        seen["peak"] = {a: s.peak_bytes for a, s in stores}
        held = {p.path for ps in held_by_rank(name, target).values() for p in ps}
        seen["in_files"] = held
        if d := piece_files.directory():  # names no holder has: each rank's piece on its way
            seen["stray"] = [n for n in os.listdir(d) if os.path.join(d, n) not in held]

    gate, thread = at_gate(tmp_path, 0, 110, measure)
    thread.start()
    config = {"steps": 112, "snapshot": True, "faults": gate}
    result = train_fast(target, name, config, snapshot_every=1)
    thread.join(10)

    assert result.status == "finished", result.error
    # 110 rounds taken; each of a rank's two holders keeps its newest two
    assert all(len(indexes) <= 2 and max(indexes) >= 109 for indexes in seen["held"].values())
    assert sorted(r for _, r in seen["held"]) == [0, 0, 1, 1], seen
    biggest = max(seen["sizes"])  # a holder holds two ranks' pieces: its own rank's, a peer's
    assert all(peak <= 2 * 2 * biggest for peak in seen["peak"].values()), seen
    if piece_files.directory():  # the pieces' memory in /dev/shm: bounded the same way
        held = sum(len(indexes) for indexes in seen["held"].values())  # a name each
        assert None not in seen["in_files"] and len(seen["in_files"]) == held, seen
        assert len(seen["stray"]) <= 2, seen
        assert not [p for p in seen["in_files"] if os.path.exists(p)]  # the run's end drops them


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Three nodes, each a nanny and its worker in a process group of their own: two ranks and a
    spare. Each rank's pieces are held by its own nanny and the other rank's (all on one host)."""
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES", "0")  # as ft-train asks
    cluster = NannyCluster(tmp_path)
    try:
        for _ in range(3):
            cluster.add_node()
        cluster.connect()
        yield cluster
    finally:
        cluster.close()


def copies(held: list[SnapshotPiece], index: int) -> set[tuple[int, str | None]]:
    """(rank, holder) of each whole copy of a piece of snapshot round `index`."""
    return {(p.rank, p.holder) for p in held if (p.index, p.kind) == (index, "snapshot")}


@pytest.mark.parametrize("pace", PACES)
def test_a_rank_whose_node_is_lost_resumes_from_the_copies_on_the_survivors_nanny(
    tmp_path, pace, fault_free, nodes, caplog
):
    # Rank 1 holds right after report 27 (the checkpoint on storage is at 20) until round 26 is
    # held in full: each rank's piece on its own nanny and on the other rank's. Then rank 1's
    # node (nanny and worker) is SIGKILLed, and one copy of every piece with it. Rank 0, in step
    # 28's all-reduce, loses its peer and saves just in time; its own nanny holds that piece.
    # The restart resumes from it, newer than any snapshot round, and asks the lost nanny no
    # more (each question would wait knobs.ANSWER_TIMEOUT_S).
    caplog.set_level(logging.INFO, logger="ft_train")
    target, name = local(tmp_path), f"snap-node-{pace}"
    run = run_key(fresh(target).uri(name))
    seen: dict = {}

    def lose_rank_1s_node() -> None:
        attempt_id = load_state(target, name).attempts[0].attempt_id
        rank_1 = nodes.running(f"ft-train-rank-1-{attempt_id}")
        seen["nanny"] = nodes.client.scheduler_info(n_workers=-1)["workers"][rank_1]["nanny"]
        held = lambda: snapshot_holders.held(nodes.client, run)  # noqa: E731
        wait_for(lambda: len(copies(held(), 26)) == 4, 30, "round 26 held in full")
        nodes.take_away(rank_1)  # its nanny, then the rest of its process group; a node joins
        seen["after"] = snapshot_holders.held(nodes.client, run, dead={seen["nanny"]})

    gate, thread = at_gate(tmp_path, 1, 27, lose_rank_1s_node)
    thread.start()
    config = {"snapshot": True, "jit": True, "step_s": pace, "faults": gate}
    result = train_fast(
        target, name, config, max_failures=1, cluster=ft_train.ClusterConfig(address=nodes.address)
    )
    thread.join(10)

    assert {rank for rank, _ in copies(seen["after"], 26)} == {0, 1}, seen  # on rank 0's nanny
    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("node_loss", 1, 27)]
    restart = load_state(target, name).attempts[1]
    assert restart.restored_from is not None and restart.restored_from.startswith(
        "checkpoint_000020-"
    ), restart
    assert restart.start_report_index == 27, restart
    assert restart.restored_snapshot.startswith("jit 27 "), restart
    asked = [r.getMessage() for r in caplog.records if "is not asked again" in r.getMessage()]
    assert not [m for m in asked if seen["nanny"] in m], asked
    assert_bit_identical(weights(result), fault_free)


@pytest.mark.parametrize("pace", PACES)
def test_every_holder_of_a_ranks_snapshots_lost_resumes_from_storage(
    tmp_path, pace, fault_free, nodes
):
    # Rank 1 holds right after report 27: the checkpoint on storage is at 20, and round 26 is
    # held in full. Then the node of every holder of rank 1's pieces is SIGKILLed (nanny and
    # worker): its own, and once the scheduler has seen it go, rank 0's. No round after 20 is
    # whole: the restart must take the checkpoint at 20, not a round it cannot fetch. The spare
    # goes first, without a replacement: the restart then waits for a new node to join (seconds)
    # and cannot start on rank 0's node before that node is lost too.
    target, name = local(tmp_path), f"snap-holder-{pace}"
    run = run_key(fresh(target).uri(name))
    seen: dict = {}

    def lose_every_holder_of_rank_1s_pieces() -> None:
        held = lambda: snapshot_holders.held(nodes.client, run)  # noqa: E731
        wait_for(lambda: len(copies(held(), 26)) == 4, 30, "round 26 held in full")
        seen["holders"] = {holder for rank, holder in copies(held(), 26) if rank == 1}
        attempt_id = load_state(target, name).attempts[0].attempt_id
        rank_1 = nodes.running(f"ft-train-rank-1-{attempt_id}")
        rank_0 = nodes.running(f"ft-train-rank-0-{attempt_id}")
        (spare,) = set(nodes.workers()) - {rank_0, rank_1}
        nodes.take_away(spare, replace=False)
        wait_for(lambda: spare not in nodes.workers(), 30, f"the scheduler to drop {spare}")
        workers = nodes.client.scheduler_info(n_workers=-1)["workers"]
        holding = [a for a, w in workers.items() if w.get("nanny") in seen["holders"]]
        for node in sorted(holding, key=lambda a: a != rank_1):  # rank 1's first
            nodes.take_away(node)  # its nanny, then the rest of its process group; a node joins
            wait_for(lambda: node not in nodes.workers(), 30, f"the scheduler to drop {node}")
        seen["after"] = snapshot_holders.held(nodes.client, run)

    gate, thread = at_gate(tmp_path, 1, 27, lose_every_holder_of_rank_1s_pieces)
    thread.start()
    config = {"snapshot": True, "step_s": pace, "faults": gate}
    result = train_fast(
        target, name, config, max_failures=1, cluster=ft_train.ClusterConfig(address=nodes.address)
    )
    thread.join(10)

    assert len(seen["holders"]) == 2, seen  # its own nanny and rank 0's
    assert not [p for p in seen["after"] if p.rank == 1], seen
    assert result.status == "finished", result.error
    # one failure of the group: the node the driver heard of first
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("node_loss", 1, 27)]
    restart = load_state(target, name).attempts[1]
    assert restart.restored_from is not None and restart.restored_from.startswith(
        "checkpoint_000020-"
    ), restart
    assert restart.restored_snapshot is None, restart
    assert restart.start_report_index == EVERY, restart
    assert_bit_identical(weights(result), fault_free)


# A node whose /dev/shm is its own (a mount namespace): another host's memory, on this one.
OWN_SHM = (
    *("unshare", "--mount", "--propagation", "private", "sh", "-c"),
    'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"',
    "sh",
)


def _own_shm_works() -> bool:
    try:
        return subprocess.run([*OWN_SHM, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("pace", PACES)
def test_a_holder_on_another_host_takes_the_bytes_and_a_restore_reads_either(
    tmp_path, pace, fault_free
):
    # Two nodes, the second with a /dev/shm of its own. A rank's piece goes to its own nanny by
    # a link to the file the rank wrote in /dev/shm, and to the nanny on the other "host" by its
    # bytes (the link fails there). Rank 1 is SIGKILLed at step 28, once round 26 is held in
    # full; rank 0 saves just in time. Each restoring rank reads the copy on its host from its
    # file, or fetches a copy's bytes: the result is the fault-free one, bit for bit.
    if piece_files.directory() is None or not _own_shm_works():
        pytest.skip("needs /dev/shm and a mount namespace of a node's own (unshare, as root)")
    target, name = local(tmp_path), f"snap-hosts-{pace}"
    run = run_key(fresh(target).uri(name))
    seen: dict = {}
    nodes = NannyCluster(tmp_path)
    try:
        nodes.add_node()
        nodes.add_node(OWN_SHM)
        nodes.connect()

        def look() -> None:
            held = lambda: snapshot_holders.held(nodes.client, run)  # noqa: E731
            wait_for(lambda: len(copies(held(), 26)) == 4, 30, "round 26 held in full")
            attempt_id = load_state(target, name).attempts[0].attempt_id
            workers = nodes.client.scheduler_info(n_workers=-1)["workers"]
            nanny = {
                r: workers[nodes.running(f"ft-train-rank-{r}-{attempt_id}")]["nanny"]
                for r in (0, 1)
            }
            seen["copies"] = {
                (p.rank, p.holder == nanny[p.rank], p.path is not None)
                for p in held()
                if p.index == 26
            }

        gate, thread = at_gate(tmp_path, 1, 27, look)
        thread.start()
        config = {"snapshot": True, "jit": True, "step_s": pace}
        config["faults"] = [*gate, kill(1, 28, tmp_path)]
        cluster = ft_train.ClusterConfig(address=nodes.address)
        result = train_fast(target, name, config, max_failures=1, cluster=cluster)
        thread.join(10)
    finally:
        nodes.close()

    # (rank, held by its own nanny, in a file): a file on the rank's host, bytes on the other
    assert seen["copies"] == {
        (0, True, True),
        (0, False, False),
        (1, True, True),
        (1, False, False),
    }
    assert result.status == "finished", result.error
    # the step the driver had heard of last: 28, or 27 where the last report was on its way
    assert [(f.kind, f.rank) for f in result.failures] == [("process_death", 1)]
    restart = load_state(target, name).attempts[1]
    assert restart.restored_snapshot is not None and restart.start_report_index >= 26, restart
    assert_bit_identical(weights(result), fault_free)


def test_a_piece_file_is_linked_by_holders_on_its_host_only_and_swept_after_its_owner_dies(
    tmp_path,
):
    d = piece_files.directory()
    if d is None:
        pytest.skip("no writable /dev/shm on this host")
    path = piece_files.write(b"piece")
    assert path is not None and os.path.dirname(path) == d
    linked = piece_files.link(path)
    assert linked is not None
    name, blob = linked
    piece_files.unlink(path)  # the rank's name goes; the holder's keeps the file
    assert bytes(blob) == b"piece" and bytes(piece_files.open_map(name)) == b"piece"
    elsewhere = tmp_path / os.path.basename(path)  # another host's directory, say
    elsewhere.write_bytes(b"piece")
    assert piece_files.link(str(elsewhere)) is None
    # a name left by a process that died (SIGKILL) is swept; a live process's stays
    dead = subprocess.Popen(["true"])
    dead.wait()
    namespace = os.path.basename(name).split("-")[0]
    left = os.path.join(d, f"{namespace}-{dead.pid}-left")
    open(left, "wb").close()
    assert piece_files.sweep() >= 1
    assert not os.path.exists(left) and os.path.exists(name)
    piece_files.unlink(name)
    assert not os.path.exists(name)


def flip_held(piece: snapshot_store.HeldPiece, at: int) -> None:
    """One bit of byte `at` of a held piece flipped where it is held: in its file in /dev/shm
    (a bit flip in the host's memory), else in the holder's bytes."""
    if piece.path is None:
        piece.blob = flipped(piece.blob, at)
        return
    with open(piece.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def flipped(blob: memoryview, at: int) -> memoryview:
    """`blob` with one bit of byte `at` flipped, as a bit flip in a holder's memory would."""
    damaged = bytearray(blob)
    damaged[at] ^= 1
    return memoryview(damaged)


def held_copy(rank: int, holder: str, index: int = 26, kind: Kind = "snapshot") -> SnapshotPiece:
    """A holder's answer for one copy of a piece (`SnapshotStore.describe`)."""
    return SnapshotPiece("a0", rank, index, kind, world_size=2, size=10, holder=holder)


def test_a_round_is_complete_while_one_copy_of_each_piece_is_held():
    held = [
        # round 26: rank 0's piece on A only, rank 1's on A and B
        *[held_copy(0, "A"), held_copy(1, "A"), held_copy(1, "B")],
        # round 28: rank 1's piece lost with both its holders
        *[held_copy(0, h, 28) for h in "AB"],
    ]
    (rnd,) = complete_rounds(held)
    assert (rnd.index, rnd.kind) == (26, "snapshot")
    # the restoring ranks are given every copy, to fetch the first that is whole
    assert [(p.rank, p.holder) for p in rnd.pieces] == [(0, "A"), (1, "A"), (1, "B")]
    tier = SnapshotTier(lineage=["a0"])
    assert tier.choose(held, newer_than=20) == rnd
    assert tier.choose(held, newer_than=26) is None
    # a rank found no copy of a piece of round 26 whole: passed over from then on
    assert tier.unusable("snapshot://a0/26")
    assert tier.choose(held, newer_than=20) is None

    # a just-in-time round: the survivors' pieces, whichever ranks they were
    jit = [held_copy(0, "A", 27, "jit"), held_copy(0, "B", 27, "jit")]
    assert [(r.index, r.kind, len(r.pieces)) for r in complete_rounds(jit)] == [(27, "jit", 2)]


def test_a_restoring_rank_fetches_a_whole_copy_of_each_piece(tmp_path):
    # Holders on a real (in-process) Dask cluster. Rank 0's piece: a damaged copy listed first,
    # then a whole one. Rank 1's: a copy its holder no longer has, then a whole one.
    from distributed import Client, LocalCluster

    run = "restore-" + tmp_path.name

    def writes(text: str):
        return lambda d: open(os.path.join(d, f"{text}.txt"), "w").write(text)

    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(snapshot_store.SnapshotWorkerHolder())
        a, b = sorted(client.scheduler_info()["workers"])
        blobs, pieces = [pack(writes("zero")), pack(writes("one"))], []
        for rank, blob in enumerate(blobs):
            piece = replace(held_copy(rank, b), size=len(blob))
            assert snapshot_store.STORES[b].put(run, piece.to_dict(), blob) == {"status": "OK"}
            pieces += [replace(piece, holder=a), piece]
        assert snapshot_store.STORES[a].put(run, pieces[0].to_dict(), blobs[0]) == {"status": "OK"}
        (damaged,) = snapshot_store.STORES[a].pieces[(run, 0)]
        damaged.blob = flipped(damaged.blob, bytes(damaged.blob).index(b"zero", 38))  # a byte of
        # the file's, after the zip's header (30 bytes and the name): only its CRC-32 tells

        def restore(pieces: list[SnapshotPiece]) -> dict[str, str]:  # on a worker, as a rank would
            snapshots = RankSnapshots(run, "a1", 0, 2, [], 2)
            round_26 = SnapshotRound("a0", 26, "snapshot", tuple(pieces))
            try:
                with snapshots.restored(round_26).as_directory() as d:
                    return {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))}
            finally:
                snapshots.close()

        assert client.submit(restore, pieces, pure=False).result() == {
            "one.txt": "one",
            "zero.txt": "zero",
        }
        with pytest.raises(CheckpointDamagedError, match="no copy of rank 1's piece"):
            client.submit(restore, pieces[:3], pure=False).result()
        if (path := piece_files.write(blobs[0])) is not None:
            # a copy in a file on this host is read from it: its holder (none here) not asked
            in_file = replace(pieces[1], holder="tcp://127.0.0.1:9", path=path)
            try:
                assert client.submit(restore, [in_file, pieces[3]], pure=False).result() == {
                    "one.txt": "one",
                    "zero.txt": "zero",
                }
            finally:
                piece_files.unlink(path)


def test_a_state_snapshot_is_copied_in_report_and_sent_in_the_background(tmp_path):
    # report(snapshot={file: state}) returns once the tensors are copied; the training changes
    # them at once, while the piece is sealed and sent on another thread: the held piece is the
    # state of the report. A sparse tensor goes through torch.save instead; a state that
    # torch.save cannot take fails its report, by name.
    from distributed import Client, LocalCluster, get_worker

    run = "staged-" + tmp_path.name

    def reports() -> str:  # on a worker, as a rank's reports would be
        snapshots = RankSnapshots(run, "a1", 0, 1, [get_worker().address], 1)
        weight = torch.zeros(1_000_000)
        try:
            for index in (1, 2):
                weight.fill_(index)
                snapshots.offer({"rank0.pt": {"weight": weight, "index": index}}, index)
                weight.fill_(-1)  # the next step, while the piece is sent
            sparse = torch.eye(3).to_sparse()
            snapshots.offer({"rank0.pt": {"weight": sparse, "index": 3}}, 3)
            with pytest.raises(SessionError, match="cannot be saved with torch.save") as e:
                snapshots.offer({"rank0.pt": {"weight": weight, "hook": lambda: 0}}, 4)
            return str(e.value)
        finally:
            snapshots.close()

    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(snapshot_store.SnapshotWorkerHolder())
        (holder,) = client.scheduler_info()["workers"]
        assert "lambda" in client.submit(reports, pure=False).result()
        held = snapshot_store.STORES[holder].pieces[(run, 0)]
        assert [h.piece.index for h in held] == [2, 3]  # two rounds a rank
        for h in held:
            out = tmp_path / f"piece-{h.piece.index}"
            out.mkdir()
            whole(h.blob)(str(out))
            state = torch.load(out / "rank0.pt")
            assert state["index"] == h.piece.index
        assert piece_format.is_flat(held[0].blob) and not piece_format.is_flat(held[1].blob)
        assert torch.equal(state["weight"].to_dense(), torch.eye(3))
        state = torch.load(tmp_path / "piece-2" / "rank0.pt")
        assert torch.equal(state["weight"], torch.full((1_000_000,), 2.0))


def test_a_flat_piece_gives_back_its_state_and_any_damage_is_told():
    # What torch.save keeps: dtypes, shapes, empty tensors, a Parameter, a tensor named twice.
    w = torch.randn(4, 5)
    files = {
        "a.pt": {"w": w, "again": w, "bf16": torch.ones(3, dtype=torch.bfloat16), "step": 7},
        "b.pt": {"empty": torch.empty(0, 3), "p": torch.nn.Parameter(torch.arange(4.0))},
    }
    piece = piece_format.seal(piece_format.FlatStager(reuse=True).stage(files))
    back = piece_format.load(bytes(piece))
    a, b = back["a.pt"], back["b.pt"]
    assert torch.equal(a["w"], w) and a["again"] is a["w"] and a["step"] == 7
    assert a["bf16"].dtype == torch.bfloat16 and torch.equal(a["bf16"], files["a.pt"]["bf16"])
    assert b["empty"].shape == (0, 3) and isinstance(b["p"], torch.nn.Parameter)
    assert torch.equal(b["p"], torch.arange(4.0))
    for at in range(0, len(piece), max(1, len(piece) // 97)):  # its CRC, header, data
        with pytest.raises(ValueError, match="damaged"):
            whole(flipped(piece, at))


@pytest.mark.parametrize(
    ("snapshot", "says"),
    [
        ([1, 2], "give {file name: state}"),
        ({"ckpt/rank0.pt": {}}, "each key is a plain file name"),
        ({"..": {}}, "not a file name"),
    ],
)
def test_a_snapshot_that_is_not_files_of_state_is_refused_by_name(snapshot, says):
    with pytest.raises(SessionError, match=re.escape(says)):
        RankSnapshots("run", "a1", 0, 1, [], 1).offer(snapshot, 1)


@pytest.mark.parametrize("kw", [{}, {"save": lambda d: None, "files": dict}])
def test_a_just_in_time_save_takes_one_of_save_and_files(kw):
    with pytest.raises(SessionError, match="give save .* or files .* one of them"):
        ft_train.enable_jit_checkpoint(**kw)
