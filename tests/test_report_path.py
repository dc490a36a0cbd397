"""The report() path: asynchronous checkpoint uploads, the agreement read one report later, and
uploads that read each file once.

Unit tests drive a `Session` or `Uploads` directly against real storage (a local path and the
loopback S3); the agreement tests run two real processes over gloo; the integration tests run the
flow on a local Dask cluster, with faults at (rank, step)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import ft_train
from ft_train.compat.torch_distributed import control_group
from ft_train.knobs import AGREE_EVERY_MAX
from ft_train.storage.checkpoint import MANIFEST, Checkpoint
from ft_train.storage.checkpoint_manager import CHECKPOINT_DIR, checkpoint_dir_name
from ft_train.storage.fs import Storage, file_digest
from ft_train.worker import preemption
from ft_train.worker.rank import free_port
from ft_train.worker.session import Session
from ft_train.worker.uploads import Uploads
from tests.helpers import load_state, wait_for
from tests.uploads import (
    ATTEMPT_ID,
    GatedStorage,
    digest,
    spec,
    staged_dirs,
    write_checkpoint,
)

REPO = str(Path(__file__).resolve().parents[1])
# -- Storage.upload_dir --------------------------------------------------------------------------


SOURCES = ["tmp", "/dev/shm"]  # /dev/shm: another filesystem, where no in-kernel copy may be


@pytest.mark.parametrize("source", SOURCES)
def test_upload_dir_stores_every_file_with_the_manifest_checksums(storage, tmp_path, source):
    """Hashing while uploading gives the same sizes and sha256 as hashing the file on its own
    (what restores verify against), for empty, small, nested and multi-chunk files."""
    if source != "tmp" and not os.path.isdir(source):
        pytest.skip(f"no {source} here")
    files = {
        "empty": b"",
        "small.pt": b"weights",
        "nested/dir/rng.pt": os.urandom(1000),
        "big.bin": os.urandom(8 * 2**20 + 12345),  # more than one chunk
    }
    root = tmp_path if source == "tmp" else tempfile.mkdtemp(dir=source)
    local = write_checkpoint(root, files)
    st = Storage(storage.path, storage.options)
    infos = st.upload_dir(local, "run/ckpt")
    assert infos == {rel: file_digest(os.path.join(local, rel)) for rel in files}
    assert infos == {rel: digest(data) for rel, data in files.items()}
    for rel, data in files.items():
        assert st.read_bytes(f"run/ckpt/{rel}") == data, rel
    if root != tmp_path:
        shutil.rmtree(root)


# -- asynchronous uploads, driven without Dask ---------------------------------------------------


def test_async_report_returns_before_the_upload_and_its_message_follows_it(storage, tmp_path):
    st = GatedStorage(storage.path, storage.options)
    msgs: list = []
    session = Session(spec(st), msgs.append)
    staging = str(tmp_path / "staging")
    session._uploads = Uploads(st, msgs.append, staging_root=staging)
    files = {"model.pt": os.urandom(3 * 2**20), "sub/rng.pt": b"rng"}
    local = write_checkpoint(tmp_path, files)

    session.report({"loss": 0.5}, Checkpoint.from_directory(local), checkpoint_upload_mode="async")
    shutil.rmtree(local)  # allowed as soon as report() returns, with the upload still held
    wait_for(lambda: st.started, 30, "the upload to start")
    assert msgs == []  # no message before every file is stored
    assert len(staged_dirs(staging)) == 1

    st.gate.set()
    session.finish()  # waits for the pending upload
    (msg,) = msgs
    dir_name = checkpoint_dir_name(1, 0, ATTEMPT_ID)
    assert msg.wire() == {
        "rank": 0,
        "index": 1,
        "metrics": {"loss": 0.5},
        "dir_name": dir_name,
        "files": {rel: digest(data) for rel, data in files.items()},
    }
    for rel, data in files.items():
        assert st.read_bytes(f"run/{dir_name}/{rel}") == data
    assert staged_dirs(staging) == []  # the snapshot went once it was uploaded
    session.close()
    assert os.listdir(staging) == []  # and the session's own staging directory on close


def test_async_uploads_are_bounded_and_sent_in_order(tmp_path):
    st = GatedStorage(str(tmp_path / "runs"))
    msgs: list = []
    session = Session(spec(st), msgs.append)
    session._uploads = Uploads(
        st, msgs.append, max_in_flight=2, staging_root=str(tmp_path / "staging")
    )

    def report_async(i: int) -> None:
        local = write_checkpoint(tmp_path, {"w.pt": b"w%d" % i})
        session.report({"i": i}, Checkpoint.from_directory(local), checkpoint_upload_mode="async")
        shutil.rmtree(local)

    report_async(1)
    report_async(2)  # two in flight: both return at once
    third = threading.Thread(target=report_async, args=(3,))
    third.start()
    third.join(timeout=1.0)
    assert third.is_alive(), "a third upload must wait while two are pending"
    st.gate.set()
    third.join(timeout=30)
    assert not third.is_alive()
    session.finish()
    assert [m.index for m in msgs] == [1, 2, 3]
    assert [m.files["w.pt"] for m in msgs] == [digest(b"w%d" % i) for i in (1, 2, 3)]
    session.close()


def test_a_file_rewritten_in_place_during_its_upload_fails_finish(storage, tmp_path):
    st = GatedStorage(storage.path, storage.options)
    session = Session(spec(st), [].append)
    session._uploads = Uploads(st, session.send, staging_root=str(tmp_path / "staging"))
    local = write_checkpoint(tmp_path, {"w.pt": b"before"})
    session.report({"i": 1}, Checkpoint.from_directory(local), checkpoint_upload_mode="async")
    wait_for(lambda: st.started, 30, "the upload to start")
    # Against the contract: the file is rewritten in place while its upload is pending. The
    # upload must fail rather than store a checkpoint that may be torn.
    with open(os.path.join(local, "w.pt"), "r+b") as f:
        f.write(b"AFTER!!!")
    st.gate.set()
    with pytest.raises(ft_train.StorageError, match="written to after report"):
        session.finish()
    session.close()


def _snapshot_then_die(root: str, src: str) -> None:  # in a child process
    uploads = Uploads(Storage(root + "-unused"), print, staging_root=root)
    uploads._snapshot(src, 1)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_process_leaves_a_snapshot_that_the_next_session_removes(tmp_path):
    root, src = str(tmp_path / "staging"), write_checkpoint(tmp_path, {"w.pt": b"w" * 1000})
    alive = Uploads(Storage(str(tmp_path / "runs")), print, staging_root=root)
    alive._snapshot(src, 1)  # a live session's snapshot, which no sweep may touch
    code = f"from tests.test_report_path import _snapshot_then_die as f; f({root!r}, {src!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO)
    )
    assert proc.returncode == -signal.SIGKILL
    assert len(staged_dirs(root)) == 2  # the dead process's snapshot is still there

    later = Uploads(Storage(str(tmp_path / "runs")), print, staging_root=root)
    later._snapshot(src, 1)  # its first use of the root sweeps it
    left = staged_dirs(root)
    assert len(left) == 2
    owners = {Path(p).parent.name for p in left}
    assert owners == {Path(alive._own[root][0]).name, Path(later._own[root][0]).name}
    alive.close()
    later.close()
    assert os.listdir(root) == []


# -- staging_dir ---------------------------------------------------------------------------------


def test_a_checkpoint_in_the_staging_dir_uploads_async_from_a_hard_linked_snapshot(storage):
    st = GatedStorage(storage.path, storage.options)
    msgs: list = []
    session = Session(spec(st), msgs.append)
    data = os.urandom(2**20)
    with ft_train.staging_dir(len(data)) as d:
        Path(d, "model.pt").write_bytes(data)
        session.report({"loss": 1.0}, Checkpoint.from_directory(d), checkpoint_upload_mode="async")
        assert os.stat(Path(d, "model.pt")).st_nlink == 2  # linked in memory, not copied to disk
    wait_for(lambda: st.started, 30, "the upload to start")
    assert msgs == []
    st.gate.set()
    session.finish()
    dir_name = checkpoint_dir_name(1, 0, ATTEMPT_ID)
    assert msgs[0].files == {"model.pt": digest(data)}
    assert st.read_bytes(f"run/{dir_name}/model.pt") == data
    session.close()


def _stage_then_die() -> None:  # in a child process
    with ft_train.staging_dir(2**20) as d:
        Path(d, "model.pt").write_bytes(b"x" * 2**20)
        print(d, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_process_staging_dir_is_removed_by_the_next_process_that_stages():
    def run(code):
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            text=True,
            capture_output=True,
            env=dict(os.environ, PYTHONPATH=REPO),
        )

    proc = run("from tests.test_report_path import _stage_then_die as f; f()")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = Path(proc.stdout.strip())
    assert (left / "model.pt").stat().st_size == 2**20  # 1 MB of memory, until someone sweeps
    assert run("import ft_train\nwith ft_train.staging_dir(2**20): pass").returncode == 0
    assert not left.parent.exists()  # the dead process's directory, with what it held


# -- the agreement, one report later, over gloo ----------------------------------------------------


def _agreement_rank(rank: int, port: int, script: str, out) -> None:  # in a child process
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    msgs: list = []
    paced = script.endswith("_paced")  # a report every ~5 ms, agreements every ~50 ms of them
    rank_spec = dataclasses.replace(
        spec(Storage(tempfile.mkdtemp()), rank, 2), agreement_interval_s=0.05 if paced else 0.0
    )
    session = Session(rank_spec, msgs.append)
    session.control = control_group()
    seen: dict = {"rank": rank}
    try:
        if script == "notice_then_stop_paced":
            for k in range(1, 200):
                if k == 20 and rank == 1:
                    preemption._deadline = time.time() + 60
                if k == 60:
                    preemption.request_stop(ATTEMPT_ID)
                time.sleep(0.005)
                session.report({"k": k})
                if session.preemption is not None and "preempted_at" not in seen:
                    seen["preempted_at"] = k
        elif script == "unequal_paced":  # rank 1 reports once more, both between agreements
            for k in range(1, 41 + rank):
                time.sleep(0.005)
                session.report({"k": k})
            session.finish()
            seen["finished"] = True
        elif script == "notice_then_stop":
            for k in range(1, 10):
                if k == 3 and rank == 1:
                    preemption._deadline = time.time() + 60  # what its SIGTERM handler sets
                if k == 5:
                    preemption.request_stop(ATTEMPT_ID)  # what the driver runs on every worker
                session.report({"k": k})
                info = session.preemption
                if info is not None and "preempted_at" not in seen:
                    seen["preempted_at"], seen["ranks"] = k, list(info.ranks)
        elif script == "threads":
            session.report({"k": 1})
            session.finish()
            seen["threads"] = [
                Path(f"/proc/self/task/{t}/comm").read_text().strip()
                for t in os.listdir("/proc/self/task")
            ]
        else:  # "unequal": rank 1 reports once more than rank 0
            for k in range(1, 4 + rank):
                session.report({"k": k})
            session.finish()
            seen["finished"] = True
    except preemption.GroupStop:
        seen["stopped_at"] = session.report_index
    except ft_train.SessionError as e:
        seen["error"] = str(e)
    seen["preempted_msgs"] = [m.index for m in msgs if m.preempted is not None]
    seen["agreements"] = session.agreements
    out.put(seen)
    dist.destroy_process_group()


def run_two_ranks(script: str) -> dict[int, dict]:
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_agreement_rank, args=(r, port, script, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return {r["rank"]: r for r in results}


def test_every_rank_learns_a_notice_and_a_stop_at_the_same_later_report():
    """A notice that rank 1 has at its 3rd report reaches every rank at the 4th; a stop asked
    before the 5th stops every rank at the 6th (the agreement is read one report later)."""
    seen = run_two_ranks("notice_then_stop")
    for rank in (0, 1):
        assert seen[rank]["preempted_at"] == 4, seen
        assert seen[rank]["ranks"] == [1], seen
        assert seen[rank]["preempted_msgs"] == [4], seen  # round 4 tells the driver
        assert seen[rank]["stopped_at"] == 6, seen


def test_unequal_report_counts_fail_both_ranks():
    seen = run_two_ranks("unequal")
    for rank in (0, 1):
        assert "finished" not in seen[rank], seen
        assert "same number of times" in seen[rank]["error"], seen
    assert "at report 4" in seen[1]["error"]  # its 4th report met rank 0's return


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names from /proc")
def test_the_control_group_shares_the_default_groups_gloo_device():
    """One gloo device, so one `gloo_tcp_loop` thread, waking every 10 ms, per rank: a second
    group of its own would add another in every rank, beside the user's training thread."""
    seen = run_two_ranks("threads")
    for rank in (0, 1):
        assert seen[rank]["threads"].count("gloo_tcp_loop") == 1, seen


def test_with_reports_close_together_the_ranks_agree_less_often_and_still_together():
    """agreement_interval_s=0.05 with a report every ~5 ms: an agreement every ~10 reports (at
    most AGREE_EVERY_MAX); a notice at rank 1's 20th report and a stop asked before the 60th
    still reach both ranks at the same report, within AGREE_EVERY_MAX + 1 reports."""
    seen = run_two_ranks("notice_then_stop_paced")
    learned, stopped = seen[0]["preempted_at"], seen[0]["stopped_at"]
    assert 20 < learned <= 20 + AGREE_EVERY_MAX + 1, seen
    assert 60 < stopped <= 60 + AGREE_EVERY_MAX + 1, seen
    for rank in (0, 1):
        assert (seen[rank]["preempted_at"], seen[rank]["stopped_at"]) == (learned, stopped), seen
        assert seen[rank]["preempted_msgs"] == [learned], seen
        assert seen[rank]["agreements"] <= stopped // 3, seen  # not one a report


def test_unequal_report_counts_between_agreements_fail_both_ranks():
    seen = run_two_ranks("unequal_paced")
    for rank in (0, 1):
        assert "finished" not in seen[rank], seen
        assert "same number of times" in seen[rank]["error"], seen


# -- through the flow, on a local Dask cluster ---------------------------------------------------


def async_loop(config: dict) -> None:
    """Every `every` steps and at the end, each rank attaches its own file to an asynchronous
    checkpoint (rank 0's is `big` bytes, derived from the step) and deletes its directory right
    after report() returns. Restores check the contents. Faults, each once (a marker file) and
    once the previous checkpoint is committed: "kill_after_report" SIGKILLs the rank right after
    that step's report() returned (its upload pending); "block_upload" puts a directory where the
    rank's own file of that step's checkpoint must go (a real storage error)."""
    ctx = ft_train.get_context()
    rank, every, steps = ctx.get_world_rank(), config["every"], config["steps"]
    start, resumed_from = 0, None
    ckpt = ft_train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start = resumed_from = json.loads(Path(d, f"rank{rank}.json").read_text())["step"]
            big = Path(d, "big.bin").read_bytes()
            if big != step_bytes(start, config["big"]):
                raise AssertionError(f"restored big.bin is not the one of step {start}")
    for step in range(start + 1, steps + 1):
        metrics = {"step": step, "resumed_from": resumed_from}
        fault = fires(config, rank, step)
        if fault is not None:  # each fault waits for the previous checkpoint's commit
            where = SimpleNamespace(path=config["storage"], options=config["options"])
            wait_for(
                lambda: (
                    (
                        load_state(where, config["name"]) or SimpleNamespace(report_index=0)
                    ).report_index
                    >= step - every
                ),
                60,
                "the previous checkpoint's commit",
            )
        if step % every and step != steps:
            ft_train.report(metrics)
            continue
        if fault == "block_upload":
            from ft_train.worker.session import _current

            dir_name = checkpoint_dir_name(step, ctx.get_attempt(), _current().spec.attempt_id)
            in_the_way = Path(config["storage"], config["name"], dir_name, f"rank{rank}.json")
            in_the_way.mkdir(parents=True)
        d = tempfile.mkdtemp(prefix="user-ckpt-")
        Path(d, f"rank{rank}.json").write_text(json.dumps({"step": step}))
        if rank == 0:
            Path(d, "big.bin").write_bytes(step_bytes(step, config["big"]))
        ft_train.report(
            metrics,
            checkpoint=ft_train.Checkpoint.from_directory(d),
            checkpoint_upload_mode="async",
        )
        shutil.rmtree(d)  # the contract allows it at once
        if fault == "kill_after_report":
            os.kill(os.getpid(), signal.SIGKILL)


def step_bytes(step: int, n: int) -> bytes:
    return hashlib.sha256(str(step).encode()).digest() * (n // 32)


def fires(config: dict, rank: int, step: int):
    for f in config.get("faults", ()):
        if (f["rank"], f["step"]) == (rank, step):
            try:
                os.close(os.open(f["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return None  # fired before
            return f["kind"]
    return None


def run_async(storage, name, faults, steps=12, every=3, big=16 * 2**20, max_failures=1):
    from flows.train import train

    config = {
        "steps": steps,
        "every": every,
        "big": big,
        "faults": faults,
        "storage": storage.path,
        "options": storage.options,
        "name": name,
    }
    return train(
        train_loop="tests.test_report_path:async_loop",
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=storage.path,
            storage_options=storage.options,
            failure_config=ft_train.FailureConfig(max_failures=max_failures),
        ),
    )


def assert_committed_and_nothing_else(storage, name, state) -> None:
    """Every committed checkpoint verifies against its manifest; no other checkpoint directory
    is left in storage (an interrupted upload's directory was collected)."""
    st = Storage(storage.path, storage.options)
    on_storage = [n for n in st.list_dir(name) if CHECKPOINT_DIR.match(n)]
    assert sorted(on_storage) == sorted(c.dir_name for c in state.checkpoints)
    for c in state.checkpoints:
        ckpt = Checkpoint(st.uri(f"{name}/{c.dir_name}"), storage.options)
        with tempfile.TemporaryDirectory() as d:
            ckpt.download_verified(d)  # raises on a missing or different file
            assert sorted(os.listdir(d)) == sorted(
                ["rank0.json", "rank1.json", "big.bin", MANIFEST]
            )


@pytest.mark.usefixtures("prefect_api")
def test_async_checkpoints_commit_and_a_rank_killed_mid_upload_restarts_from_a_committed_one(
    storage, tmp_path
):
    name = f"async-kill-{storage.kind}"
    kill = {"rank": 0, "step": 6, "kind": "kill_after_report", "marker": str(tmp_path / "kill")}
    result = run_async(storage, name, [kill])

    assert result.status == "finished" and result.error is None
    assert [(f.kind, f.rank) for f in result.failures] == [("process_death", 0)]
    state = load_state(storage, name)
    # The restart is from a committed checkpoint: step 3's (committed before the kill), or step
    # 6's only if its upload finished before the kill; the training function found its files
    # intact (async_loop checks them).
    restored = state.attempts[1].restored_from
    assert restored.startswith(("checkpoint_000003-a0-", "checkpoint_000006-a0-"))
    assert result.last_metrics["resumed_from"] == state.attempts[1].start_report_index
    # finish() waited for the last upload: the final checkpoint is committed
    assert state.latest.startswith("checkpoint_000012-a1-") and result.last_metrics["step"] == 12
    assert [c.report_index for c in state.checkpoints][-2:] == [9, 12]
    assert_committed_and_nothing_else(storage, name, state)


@pytest.mark.usefixtures("prefect_api")
def test_a_failed_async_upload_is_a_rank_failure_and_the_run_retries(tmp_path):
    from tests.conftest import StorageTarget

    storage = StorageTarget("local", str(tmp_path / "runs"))
    name = "async-upload-fails"
    block = {"rank": 1, "step": 6, "kind": "block_upload", "marker": str(tmp_path / "block")}
    result = run_async(storage, name, [block])

    assert result.status == "finished"
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("exception", 1), failure
    assert "asynchronous upload of report 6" in failure.error
    state = load_state(storage, name)
    assert state.attempts[1].restored_from.startswith("checkpoint_000003-a0-")
    assert [c.report_index for c in state.checkpoints] == [3, 6, 9, 12]
    assert all("-a1-" in c.dir_name for c in state.checkpoints[1:])
    assert_committed_and_nothing_else(storage, name, state)
