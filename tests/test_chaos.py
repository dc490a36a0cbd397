"""Chaos: one deterministic training run (the digits demo, 2 ranks, 48 steps, a checkpoint every
3) survives a schedule of 20+ injected faults of every kind, and ends bit-identical to a
fault-free run of the same config, with every fault in its run state's history, in order, with
its kind, rank and step, each restart resumed from the latest committed checkpoint.

Each fault fires once, at a given (rank, step) of the training loop (ft_train.testing.faults, with a
marker file). Faults a rank cannot do to itself (its node taken away, its worker told to leave,
the driver killed) are gated: the rank holds at its step and the test acts once the gate's marker
exists. No sleeps: every wait is a bounded wait for a condition.

The run has two driver runs, split by the driver crash of the schedule:
1. a driver in a subprocess, with its own local Dask cluster (the embedded default), SIGKILLed
   with its whole process group once it holds right after the crash's checkpoint;
2. the same name rerun in this process, on an external cluster (worker nodes of a nanny and its
   worker, reached by address), where the test can take a node away or send its worker SIGTERM.

To add a kind: a `Kind` in KINDS (what the rank injects, the failure kind the run state must
record, whether it is charged, and for a gated kind the test's action), then SCHEDULE entries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ft_train
from tests.external_clusters import FORK_WARM_WORKERS, NannyCluster
from tests.helpers import DEMO, REPO, load_state, train_demo, wait_for

# 2 ranks x 750 images / batch 64 = 12 steps an epoch; 4 epochs = 48 steps
CONFIG = {"epochs": 4, "checkpoint_every": 3, "batch_size": 64, "seed": 0}
STEPS, EVERY = 48, 3
HANG_TIMEOUT_S = 8.0  # ranks' collectives time out at 0.8 x this
GATE_TIMEOUT_S = 300  # bound on waiting for a rank to reach a gate (restarts included)
# Workers per cluster: 2 ranks and spares. Every fault costs a worker (a failed or hung rank's
# process is killed; its nanny starts a new one); spares keep the run going meanwhile.
WORKERS = 4
# A LocalCluster closes for good a nanny whose worker is not back when 15 s (this setting) have
# passed since an earlier loss of it: with repeated kills of one worker it shrinks until no rank
# can start. ft_train.driver.cluster does not set it (yet).
KEEP_NANNIES = {"DASK_DISTRIBUTED__DEPLOY__LOST_WORKER_TIMEOUT": "1 hour"}


# -- the schedule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    inject: str  # the ft_train.testing.faults kind the rank runs at (rank, step)
    recorded: str  # FailureRecord.kind the run state must show
    charged: bool = True  # counts toward max_failures
    exact_step: bool = True  # the record's step is the last report before the fault (see kill)
    ranked: bool = True  # the record names the rank
    external: bool = False  # needs the external cluster (phase 2)
    action: Callable[[Chaos, Fault], None] | None = None  # the test's part, at the gate


@dataclass(frozen=True)
class Fault:
    step: int
    rank: int
    kind: str

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    def marker(self, root: Path) -> str:
        return str(root / f"fault-{self.step:02d}-rank{self.rank}-{self.kind}")


def take_node_away(chaos: Chaos, fault: Fault) -> None:
    chaos.cluster.take_away(chaos.rank_worker(fault.rank))


def tell_worker_to_leave(chaos: Chaos, fault: Fault) -> None:
    chaos.cluster.sigterm(chaos.rank_worker(fault.rank))


KINDS: dict[str, Kind] = {
    "raise": Kind("raise", "exception"),
    # A SIGKILLed rank's last reports die with its process (they are batched), but not its
    # journal: the record's step is exact (ft_train.worker.journal).
    "kill": Kind("kill", "process_death"),
    "hang": Kind("hang", "hang"),
    # The rank's whole process stops (SIGSTOP), its Dask worker too: a hang whose worker cannot
    # be killed; the run leaves it behind (WorkerGroup.kill gives up on it). Its queued reports
    # stop with it, as a killed rank's die with it.
    "freeze": Kind("freeze", "hang", exact_step=False),
    "node_loss": Kind("wait", "node_loss", external=True, action=take_node_away),
    # The rank holds until its worker has notice, which it has at its next report; every rank
    # learns it at the call after that, the same step's get_preemption_info() (the agreement
    # started at one call is read at the next), and saves a just-in-time checkpoint (an extra
    # report, unless that step checkpointed anyway).
    "preemption": Kind(
        "until_preempted", "preemption", charged=False, external=True, action=tell_worker_to_leave
    ),
    # the phase boundary, handled by the test itself; on a checkpoint step
    "driver_crash": Kind("wait", "driver_crash", charged=False, ranked=False),
}

# (step, rank, kind) in step order; one fault per step, so the schedule's order is the faults'.
# Rank faults avoid checkpoint steps (multiples of 3): a rank failing right after it reported a
# checkpoint would race that checkpoint's commit.
SCHEDULE = [
    Fault(*f)
    for f in [
        (1, 0, "raise"),
        (2, 1, "kill"),
        (4, 1, "raise"),
        (5, 0, "kill"),
        (7, 1, "hang"),
        (8, 0, "raise"),
        (10, 1, "kill"),
        (11, 0, "freeze"),
        (13, 0, "raise"),  # the first step of epoch 2, resumed from the epoch boundary
        (14, 1, "raise"),
        (16, 0, "kill"),
        (20, 1, "raise"),
        (24, 0, "driver_crash"),  # phase 1 ends: SIGKILL of the driver at checkpoint 24
        (25, 1, "raise"),
        (26, 0, "node_loss"),
        (28, 1, "kill"),
        (29, 0, "raise"),
        (31, 0, "hang"),
        (32, 1, "node_loss"),
        (34, 0, "kill"),
        (35, 1, "preemption"),  # learned at step 36, a checkpoint anyway
        (37, 1, "raise"),  # the first step of epoch 4
        (38, 0, "raise"),
        (40, 1, "kill"),
        (43, 0, "preemption"),  # learned at step 44: a just-in-time checkpoint, one report more
        (46, 1, "raise"),
        (47, 0, "kill"),  # the last step
    ]
]


def check_schedule() -> tuple[list[Fault], Fault, list[Fault]]:
    steps = [f.step for f in SCHEDULE]
    assert steps == sorted(set(steps)) and steps[-1] < STEPS, "one fault per step, in order"
    (crash,) = [f for f in SCHEDULE if f.kind == "driver_crash"]
    assert crash.step % EVERY == 0, "the driver is killed right after a checkpoint"
    before = [f for f in SCHEDULE if f.step < crash.step]
    after = [f for f in SCHEDULE if f.step > crash.step]
    assert not any(f.spec.external for f in before), "phase 1 runs on a local cluster"
    assert all(f.step % EVERY for f in before + after), "no rank fault on a checkpoint step"
    return before, crash, after


@dataclass(frozen=True)
class Expected:
    step: int  # the record's step: the report index when it happened (an upper bound for kill)
    restore: int  # the report index of the checkpoint the next attempt starts from (0: none)
    restore_step: int  # that checkpoint's training step (the loop's `resumed_from`)


def timeline() -> tuple[list[Expected], list[int]]:
    """What each fault of SCHEDULE must leave in the run state, and the report index of every
    checkpoint. One report per training step, plus one for each just-in-time checkpoint."""
    jit = {f.step + 1 for f in SCHEDULE if f.kind == "preemption" and (f.step + 1) % EVERY}

    def index(step: int) -> int:  # the last report index once `step` is done
        return step + sum(j <= step for j in jit)

    checkpoints = sorted(set(range(EVERY, STEPS + 1, EVERY)) | jit)
    expected = []
    for f in SCHEDULE:
        if f.kind == "preemption":  # learned a step later; saved then, or at the JIT one
            expected.append(Expected(index(f.step + 1), index(f.step + 1), f.step + 1))
        else:
            at = max((c for c in checkpoints if c <= f.step), default=0)
            expected.append(Expected(index(f.step), index(at), at))
    return expected, [index(c) for c in checkpoints]


# -- the clusters and drivers --------------------------------------------------------------------


@dataclass
class Chaos:
    """What a gate's action may act on."""

    cluster: NannyCluster
    storage: object
    name: str

    def rank_worker(self, rank: int) -> str:
        """The worker of `rank` in the latest attempt (a rank's Dask key names its attempt)."""
        attempt_id = load_state(self.storage, self.name).attempts[-1].attempt_id
        return self.cluster.running(f"ft-train-rank-{rank}-{attempt_id}")


def run_gates(faults: list[Fault], root: Path, chaos: Chaos, stop: threading.Event, errors: list):
    """In a thread beside the driver: for each gated fault in order, once its rank holds at the
    gate, do the test's part."""
    try:
        for f in faults:
            if f.spec.action is None:
                continue
            wait_for(
                lambda: stop.is_set() or os.path.exists(f.marker(root)),
                GATE_TIMEOUT_S,
                f"rank {f.rank} to reach the gate of {f}",
            )
            if stop.is_set():
                return
            f.spec.action(chaos, f)
    except BaseException as e:  # surfaced by the test once the driver returns
        errors.append(e)


def start_driver(args: dict, api_url: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PREFECT_API_URL=api_url, PYTHONPATH=REPO, **KEEP_NANNIES)
    return subprocess.Popen(
        [sys.executable, __file__, json.dumps(args)],
        env=env,
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the driver and its local Dask cluster
    )


def drive(args: dict) -> ft_train.TrainResult:
    """The driver of both phases: the demo flow with the chaos run's settings."""
    from flows.train import train

    return train(
        train_loop=DEMO,
        train_loop_config=args["config"],
        scaling_config=ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=120),
        run_config=ft_train.RunConfig(
            name=args["name"],
            storage_path=args["storage_path"],
            storage_options=args["storage_options"],
            # agreement_interval_s=0: a notice lands at the very next call (the schedule's
            # report indices count on it)
            failure_config=ft_train.FailureConfig(
                max_failures=-1, hang_timeout_s=HANG_TIMEOUT_S, agreement_interval_s=0
            ),
        ),
        cluster=ft_train.ClusterConfig(**args.get("cluster", {})),
    )


# -- the test ------------------------------------------------------------------------------------


def final_state(result: ft_train.TrainResult) -> dict:
    """The last checkpoint's training state: model, optimizer, data position."""
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "train_state.pt"), weights_only=False)


def assert_identical(a, b, where="state") -> None:
    """Bit-identical nested state dicts (tensors compared exactly, dtype included)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def reference(prefect_api, tmp_path_factory):
    """The same training, fault-free, in one go."""
    from tests.conftest import StorageTarget

    storage = StorageTarget("local", str(tmp_path_factory.mktemp("reference") / "runs"))
    result = train_demo(storage, "reference", dict(CONFIG, faults=[]))
    assert result.status == "finished" and result.failures == []
    return result


@pytest.fixture
def storage(s3_endpoint):
    """S3 only: each kind of fault is tested on its own elsewhere, most against both storages;
    this run's point is their mix, and it is the suite's longest test (100 to 130 s a storage)."""
    from tests.conftest import make_s3_target

    return make_s3_target(s3_endpoint)


@pytest.fixture
def external_cluster(tmp_path):
    cluster = NannyCluster(tmp_path)
    try:
        for _ in range(WORKERS):
            cluster.add_node()
        yield cluster  # it starts while phase 1 runs; connect() waits for it
    finally:
        cluster.close()


def test_two_dozen_faults_of_every_kind_end_bit_identical_to_a_fault_free_run(
    storage, tmp_path, prefect_api, reference, external_cluster
):
    before, crash, after = check_schedule()
    expected, checkpoint_indices = timeline()
    name = "chaos"
    faults = [
        {"rank": f.rank, "step": f.step, "kind": f.spec.inject, "marker": f.marker(tmp_path)}
        for f in SCHEDULE
    ]
    args = dict(
        name=name,
        config=dict(CONFIG, faults=faults),
        storage_path=storage.path,
        storage_options=storage.options,
    )

    # Phase 1: a driver with its own local cluster, killed with its whole process group once it
    # holds right after the crash's checkpoint.
    log = tmp_path / "driver-1.log"
    driver = start_driver(dict(args, cluster={"n_workers": WORKERS}), prefect_api, log)
    try:

        def at_gate():
            assert driver.poll() is None, f"driver exited early:\n{log.read_text()[-3000:]}"
            return os.path.exists(crash.marker(tmp_path))

        wait_for(at_gate, GATE_TIMEOUT_S, f"the driver to reach the gate of {crash}")
        crash_index = expected[SCHEDULE.index(crash)].step
        wait_for(
            lambda: load_state(storage, name).report_index >= crash_index,
            60,
            f"the checkpoint of step {crash.step} to be committed",
        )
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    killed = load_state(storage, name)
    assert killed.status == "running", "a SIGKILLed driver records nothing"
    assert killed.latest.startswith(f"checkpoint_{crash_index:06d}-")
    assert [(f.kind, f.rank) for f in killed.failures] == [
        (f.spec.recorded, f.rank) for f in before
    ], log.read_text()[-5000:]

    # Phase 2: the same name, rerun here on the external cluster, with a thread that does the
    # test's part at each gate.
    external_cluster.connect()
    stop, errors = threading.Event(), []
    chaos = Chaos(external_cluster, storage, name)
    gates = threading.Thread(
        target=run_gates, args=(after, tmp_path, chaos, stop, errors), daemon=True
    )
    gates.start()
    try:
        result = drive(dict(args, cluster={"address": external_cluster.address}))
    finally:
        stop.set()
        gates.join(timeout=60)
    assert not errors, errors

    # Every fault is in the history, in order, with its kind, rank, step and attempt; nothing else.
    state = load_state(storage, name)
    assert result.status == "finished" and result.error is None
    assert len(SCHEDULE) >= 20
    assert [f.model_dump() for f in result.failures] == [f.model_dump() for f in state.failures]
    got = [(f.kind, f.rank, f.charged) for f in state.failures]
    want = [(f.spec.recorded, f.rank if f.spec.ranked else None, f.spec.charged) for f in SCHEDULE]
    assert got == want
    for i, (record, f, e) in enumerate(zip(state.failures, SCHEDULE, expected)):
        assert record.attempt == i, (f, record)
        if f.spec.exact_step:
            assert record.step == e.step, (f, e, record)
        else:
            assert e.restore <= record.step <= e.step, (f, e, record)

    # Each fault cost one attempt, which resumed from the latest committed checkpoint: the
    # driver restored it, and the training function itself saw it (`resumed_from` of the
    # checkpoints each attempt committed).
    assert len(state.attempts) == len(SCHEDULE) + 1
    assert all(a.world_size == 2 for a in state.attempts)
    assert state.attempts[0].restored_from is None
    for attempt, f, e in zip(state.attempts[1:], SCHEDULE, expected):
        assert attempt.start_report_index == e.restore, (f, e, attempt)
        if e.restore == 0:
            assert attempt.restored_from is None, (f, attempt)
        else:
            assert attempt.restored_from.startswith(f"checkpoint_{e.restore:06d}-"), (f, attempt)
    restored_step = [0] + [e.restore_step for e in expected]  # by attempt
    assert [c.report_index for c in state.checkpoints] == checkpoint_indices
    for c in state.checkpoints:
        assert c.metrics["resumed_from"] == (restored_step[c.attempt] or None), c
    assert state.driver_runs == 2
    assert result.last_metrics["step"] == STEPS
    assert result.last_metrics["resumed_from"] == expected[-1].restore_step

    # Bit-identical to the fault-free run: weights, optimizer state, data position, metrics.
    assert_identical(final_state(result), final_state(reference))
    assert result.last_metrics["loss"] == reference.metrics["loss"]
    assert result.last_metrics["val_accuracy"] == reference.metrics["val_accuracy"]


if __name__ == "__main__":  # the driver of phase 1, in its own process (see start_driver)
    sys.path.insert(0, REPO)
    exec(FORK_WARM_WORKERS)  # for the nannies of the local cluster that the flow starts here
    drive(json.loads(sys.argv[1]))
