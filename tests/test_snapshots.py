"""The in-memory snapshot tier (`ft_train.worker.snapshots`) and the just-in-time save.

A rank's snapshot pieces are held by a peer worker's nanny. On a local cluster the nannies run
in the driver's process, which is this test's: a test reads (and damages) what they hold through
`snapshot_store.STORES`, as a measurement or a bit flip in their memory would. Losing a holder
takes a cluster whose nannies are processes of their own: the chaos test's external cluster, a
`dask scheduler` and nodes of a nanny and its worker, reached by address.

Each fault test runs the loop at a few ms a step and at 50 ms a step, and checks the final
weights bit for bit against a run without faults.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import ft_train
from ft_train.driver import snapshot_holders
from ft_train.worker import snapshot_store
from ft_train.worker.journal import run_key
from tests.conftest import StorageTarget
from tests.helpers import assert_bit_identical, fresh, load_state, run_config, wait_for
from tests.test_chaos import ExternalCluster

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


@pytest.mark.parametrize("pace", PACES)
def test_the_survivors_save_just_in_time_when_a_rank_raises(tmp_path, pace, fault_free):
    # No snapshots: rank 1 raises right after report 27; rank 0, in step 28's all-reduce, loses
    # its peer and saves the state of report 27, which the restart resumes from.
    target, name = local(tmp_path), f"jit-{pace}"
    config = {"jit": True, "step_s": pace, "faults": [kill(1, 27, tmp_path, "raise")]}
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

    def damage() -> None:  # every piece of rank 0 after the checkpoint at 20: one bit each
        wait_for(
            lambda: 26 in [p.index for p in held_by_rank(name, target).get(0, [])],
            30,
            "rank 0's piece of round 26",
        )
        for piece in held_by_rank(name, target)[0]:
            piece.blob = bytes([piece.blob[0] ^ 1]) + piece.blob[1:]
            damaged.append(piece.index)

    gate, thread = at_gate(tmp_path, 1, 27, damage)
    thread.start()
    config = {"snapshot": True, "faults": [*gate, kill(1, 28, tmp_path)]}
    result = train_fast(target, name, config, max_failures=1)
    thread.join(10)

    assert sorted(damaged) == [24, 26]
    assert result.status == "finished", result.error
    assert [(f.kind, f.rank, f.step) for f in result.failures] == [("process_death", 1, 28)]
    # the damaged rounds are passed over: storage (20), or round 28, if both its pieces (sent
    # after the damage) were held before the kill
    restart = load_state(target, name).attempts[1]
    assert restart.start_report_index in (20, 28), restart
    assert (restart.restored_snapshot is None) == (restart.start_report_index == 20), restart
    assert_bit_identical(weights(result), fault_free)


def test_holders_memory_stays_bounded_over_100_snapshot_rounds(tmp_path):
    target, name = local(tmp_path), "snap-bounded"
    seen: dict = {}

    def measure() -> None:
        seen["held"] = {r: [p.index for p in ps] for r, ps in held_by_rank(name, target).items()}
        seen["sizes"] = [len(p.blob) for ps in held_by_rank(name, target).values() for p in ps]
        seen["peak"] = {a: s.peak_bytes for a, s in snapshot_store.STORES.items()}

    gate, thread = at_gate(tmp_path, 0, 110, measure)
    thread.start()
    config = {"steps": 112, "snapshot": True, "faults": gate}
    result = train_fast(target, name, config, snapshot_every=1)
    thread.join(10)

    assert result.status == "finished", result.error
    # 110 rounds taken; each rank's holder keeps its newest two
    assert all(len(indexes) <= 2 and max(indexes) >= 109 for indexes in seen["held"].values())
    assert set(seen["held"]) == {0, 1}
    biggest = max(seen["sizes"])
    assert all(peak <= 2 * biggest for peak in seen["peak"].values()), seen


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Three nodes, each a nanny and its worker in a process group of their own: two ranks and a
    spare. Rank 1's holder is rank 0's nanny, and rank 0's is rank 1's (all on one host)."""
    monkeypatch.setenv("DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES", "0")  # as ft-train asks
    cluster = ExternalCluster(tmp_path)
    try:
        for _ in range(3):
            cluster.add_node()
        cluster.connect()
        yield cluster
    finally:
        cluster.close()


@pytest.mark.parametrize("pace", PACES)
def test_a_rank_and_the_holder_of_its_snapshots_killed_resume_from_storage(
    tmp_path, pace, fault_free, nodes
):
    # Rank 1 holds right after report 27: the checkpoint on storage is at 20, and the round of
    # 24 is held whole (report 26 returned on both ranks once their pieces of 24 were held).
    # Then the node of rank 1's holder (nanny and worker: rank 0's) is SIGKILLed, and rank 1's
    # worker process: rank 0's pieces are still held, rank 1's are gone. No round after 20 is
    # whole: the restart must take the checkpoint at 20, not a round it cannot fetch.
    target, name = local(tmp_path), f"snap-holder-{pace}"
    run = run_key(fresh(target).uri(name))
    seen: dict = {}

    def newest_whole_round() -> int | None:
        held = snapshot_holders.held(nodes.client, run)
        by_rank: dict[int, set] = {}
        for p in held:
            by_rank.setdefault(p["rank"], set()).add(p["index"])
        whole = by_rank.get(0, set()) & by_rank.get(1, set())
        seen["held"] = held
        return max((i for i in whole if i > EVERY), default=None)

    def kill_rank_1_and_its_holder() -> None:
        attempt_id = load_state(target, name).attempts[0].attempt_id
        rank_1 = nodes.running(f"ft-train-rank-1-{attempt_id}")
        pid = nodes.client.run(os.getpid, workers=[rank_1])[rank_1]
        seen["round"] = wait_for(newest_whole_round, 30, "a whole round after the checkpoint")
        (holder,) = {p["holder"] for p in seen["held"] if p["rank"] == 1}
        workers = nodes.client.scheduler_info(n_workers=-1)["workers"]
        (node,) = [a for a, w in workers.items() if w.get("nanny") == holder]
        nodes.take_away(node)  # its nanny, then the rest of its process group; a new node joins
        os.kill(pid, signal.SIGKILL)
        seen["after"] = snapshot_holders.held(nodes.client, run)

    gate, thread = at_gate(tmp_path, 1, 27, kill_rank_1_and_its_holder)
    thread.start()
    config = {"snapshot": True, "step_s": pace, "faults": gate}
    result = train_fast(
        target, name, config, max_failures=1, cluster=ft_train.ClusterConfig(address=nodes.address)
    )
    thread.join(10)

    assert seen["round"] in (24, 26), seen
    assert {p["rank"] for p in seen["after"]} == {0}, seen  # rank 0's pieces outlived the kills
    assert result.status == "finished", result.error
    # one failure of the group: rank 1's death or rank 0's node, whichever the driver heard first
    assert [(f.step, f.charged) for f in result.failures] == [(27, True)], result.failures
    restart = load_state(target, name).attempts[1]
    assert restart.restored_from is not None and restart.restored_from.startswith(
        "checkpoint_000020-"
    ), restart
    assert restart.restored_snapshot is None, restart
    assert restart.start_report_index == EVERY, restart
    assert_bit_identical(weights(result), fault_free)
