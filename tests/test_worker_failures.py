"""Worker process failures: a rank raises or is SIGKILLed; the group restarts from the latest
committed checkpoint, and each restart is charged to max_failures."""

import os

import pytest

import ft_train
from ft_train.storage.checkpoint import Checkpoint
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore
from tests.conftest import StorageTarget, on_storage
from tests.helpers import (
    DEMO,
    demo_config,
    events_of,
    fault,
    fresh,
    load_state,
    train_demo,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.mark.parametrize(
    "storage, kind", [("local", "raise"), ("s3", "kill")], indirect=["storage"]
)
def test_rank_failure_resumes_from_latest_checkpoint(storage, tmp_path, kind):
    # checkpoints every 5 steps; rank 1 fails at step 7, after the checkpoint of step 5.
    # The kill variant also runs DataLoader(num_workers=2) inside each rank, before and after
    # the restart (worker processes must not be daemonic, also once the nanny restarted them).
    config = demo_config([fault(tmp_path, 1, 7, kind)], loader_workers=2 if kind == "kill" else 0)
    name = f"fail-{kind}-{storage.kind}"  # flow runs of both storages share one Prefect API
    result = train_demo(storage, name, config, max_failures=1)

    assert result.status == "finished" and result.error is None
    assert [(f.kind, f.rank) for f in result.failures] == [
        ("exception" if kind == "raise" else "process_death", 1)
    ]
    state = load_state(storage, name)
    assert len(state.attempts) == 2  # exactly one restart
    restored = state.attempts[1].restored_from
    assert restored is not None and restored.startswith("checkpoint_000005-a0-")
    assert state.attempts[1].start_report_index == 5
    # the training function itself saw the checkpoint of step 5, not a fresh start
    assert result.last_metrics["resumed_from"] == 5
    assert result.last_metrics["step"] == 12
    assert result.checkpoint.path.endswith(state.latest)
    if kind == "raise":
        assert_prefect_shows_segments_and_the_retry(name, len(state.checkpoints))


def assert_prefect_shows_segments_and_the_retry(run_name, checkpoints):
    """In the Prefect API: the flow run is named after the run, each stretch between two
    checkpoints is its own task run, and the restart is a retry of the stretch that failed."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter

    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name={"any_": [run_name]})
        )
        task_runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id={"any_": [flow_run.id]})
        )
    # a restart's task run is renamed "train-N (restart n from report S)" (tests/test_ui_screenshot.py)
    segments = {t.name.split(" (restart ")[0]: t for t in task_runs if t.name.startswith("train-")}
    # one per checkpoint (5, 10, 12), and the last one that sees the ranks finish
    assert sorted(segments) == [f"train-{i}" for i in range(1, checkpoints + 2)]
    assert all(t.state.is_completed() for t in segments.values())
    assert [n for n, t in sorted(segments.items()) if t.run_count > 1] == ["train-2"]
    assert segments["train-2"].run_count == 2  # the failure at step 7, retried once


@on_storage("s3")
def test_max_failures_zero_fails_at_first_failure_then_a_rerun_resumes(storage, tmp_path):
    config = demo_config([fault(tmp_path, 1, 7)])
    with pytest.raises(ft_train.TrainingFailedError) as err:
        train_demo(storage, "budget-0", config, max_failures=0)
    assert "max_failures=0" in str(err.value)
    assert "exception on rank 1 after report 7" in str(err.value)
    state = load_state(storage, "budget-0")
    assert state.status == "failed" and len(state.attempts) == 1
    assert ft_train.TrainResult.from_path(storage.path, "budget-0", storage.options).error

    # The same name again with resume="must" (RunConfig.resume) and a changed training config:
    # refused before any worker starts, the run left as it was.
    from flows.train import train

    must = ft_train.RunConfig(
        name="budget-0", storage_path=storage.path, storage_options=storage.options, resume="must"
    )
    with pytest.raises(ft_train.ConfigError, match="train_loop_config.epochs: 1 -> 2"):
        train(train_loop=DEMO, train_loop_config={**config, "epochs": 2}, run_config=must)
    assert load_state(storage, "budget-0") == state

    # With the config it trained with: the run resumes from its latest checkpoint with a fresh
    # budget.
    result = train(
        train_loop=DEMO,
        train_loop_config=config,
        run_config=must,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
    )
    assert result.status == "finished"
    assert result.last_metrics["resumed_from"] == 5
    assert load_state(storage, "budget-0").driver_runs == 2  # the refused call was no driver


@on_storage("local")
def test_max_failures_two_fails_on_the_third_failure(storage, tmp_path):
    faults = [fault(tmp_path, 1, 2), fault(tmp_path, 0, 6), fault(tmp_path, 1, 9)]
    with pytest.raises(ft_train.TrainingFailedError) as err:
        train_demo(storage, "budget-2", demo_config(faults), max_failures=2)
    message = str(err.value)
    assert "3 failures exceed max_failures=2" in message
    for rank, step in [(1, 2), (0, 6), (1, 9)]:
        assert f"on rank {rank} at step {step}" in message
    state = load_state(storage, "budget-2")
    assert state.status == "failed" and len(state.failures) == 3 and len(state.attempts) == 3


@on_storage("local")
def test_unlimited_failures_survive_five(storage, tmp_path):
    faults = [fault(tmp_path, s % 2, s) for s in (1, 3, 6, 8, 11)]
    result = train_demo(storage, "budget-inf", demo_config(faults), max_failures=-1)
    assert result.status == "finished"
    assert [f.step for f in result.failures] == [1, 3, 6, 8, 11]
    assert result.last_metrics["step"] == 12


def test_errors_no_retry_can_fix_fail_at_once(storage):
    from flows.train import train

    # an import path that does not resolve: fails before any worker starts or any state is written
    with pytest.raises(ft_train.TrainLoopImportError, match="no_such_module"):
        train(
            train_loop="no_such_module:fn",
            run_config=ft_train.RunConfig(
                name="bad-import",
                storage_path=storage.path,
                storage_options=storage.options,
                failure_config=ft_train.FailureConfig(max_failures=3),
            ),
        )
    assert load_state(storage, "bad-import") is None

    # a broken report() contract is not retried either, whatever max_failures allows
    with pytest.raises(ft_train.SessionError, match="same number of times"):
        train(
            train_loop="tests.loops:unequal_reports",
            scaling_config=ft_train.ScalingConfig(num_workers=2),
            run_config=ft_train.RunConfig(
                name="unequal",
                storage_path=storage.path,
                storage_options=storage.options,
                failure_config=ft_train.FailureConfig(max_failures=3),
            ),
        )
    state = load_state(storage, "unequal")
    assert state.failures == [] and len(state.attempts) == 1 and state.status == "failed"


def test_a_group_that_keeps_failing_to_start_ends_the_run_even_with_unlimited_failures(
    tmp_path, monkeypatch
):
    from flows.train import train

    # gloo cannot bind to an interface that does not exist: every rank fails in its rendezvous
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ft-no-such-if")  # the local workers inherit it
    with pytest.raises(ft_train.TrainingFailedError, match="failed to start 3 times in a row"):
        train(
            train_loop="tests.loops:report_many",
            scaling_config=ft_train.ScalingConfig(num_workers=2),
            run_config=ft_train.RunConfig(
                name="never-starts",
                storage_path=str(tmp_path),
                failure_config=ft_train.FailureConfig(max_failures=-1),
            ),
        )
    state = RunStore(Storage(str(tmp_path)), "never-starts").load()
    assert state.status == "failed" and len(state.attempts) == 3
    assert [f.kind for f in state.failures] == ["exception"] * 3
    assert all("ft-no-such-if" in f.error for f in state.failures)


def test_invalid_config_is_refused_before_anything_runs(storage):
    from flows.train import train

    with pytest.raises(Exception, match="run_config.name"):
        train(
            train_loop="tests.loops:report_many",
            run_config={"name": "../escape", "storage_path": storage.path},
        )


def test_a_callable_train_loop_works_in_a_python_call(storage):
    from flows.train import train
    from tests.loops import report_many

    result = train(
        train_loop=report_many,
        train_loop_config={"n": 20},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name="callable", storage_path=storage.path, storage_options=storage.options
        ),
    )
    assert result.status == "finished" and result.last_metrics == {"i": 19}
    assert result.checkpoint is None


def recovered_from_hang(storage, name, hang, timeout_s):
    """Train with rank 1 hanging at step 7 (`hang`, a fault) under `hang_timeout_s`; check that
    the hang was recorded against rank 1 within the timeout plus 3 s of when it began (the time
    it was seen: a frozen worker's kill, which waits ANSWER_TIMEOUT_S, comes after), and the run
    finished from step 5. Returns the failure record."""
    from flows.train import train

    result = train(
        train_loop=DEMO,
        train_loop_config=demo_config([hang]),
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=storage.path,
            storage_options=storage.options,
            failure_config=ft_train.FailureConfig(max_failures=1, hang_timeout_s=timeout_s),
        ),
    )
    assert result.status == "finished" and result.last_metrics["resumed_from"] == 5
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("hang", 1)
    hung_at = os.path.getmtime(hang["marker"])
    assert failure.time.timestamp() - hung_at < timeout_s + 3
    return failure


def test_a_frozen_worker_process_is_left_behind_and_the_run_goes_on(tmp_path):
    """Rank 1's whole process stops (SIGSTOP: its Dask worker's event loop too, as on a machine
    that hangs). The watchdog finds the hang; the kill of a worker that cannot answer gives up
    after ANSWER_TIMEOUT_S instead of holding the recovery until the scheduler drops the worker
    (worker-ttl, 60 s), and the new group runs without it (the spare takes its place)."""
    from ft_train.knobs import ANSWER_TIMEOUT_S

    storage = StorageTarget("local", str(tmp_path / "runs"))
    failure = recovered_from_hang(storage, "frozen", fault(tmp_path, 1, 7, kind="freeze"), 5.0)
    restarted = load_state(storage, "frozen").attempts[1].started_at.timestamp()
    assert restarted - failure.time.timestamp() < ANSWER_TIMEOUT_S + 5


@on_storage("s3")
def test_a_hung_rank_is_detected_and_recovered_within_the_hang_timeout(storage, tmp_path):
    # rank 1 sleeps forever inside its loop, once
    recovered_from_hang(storage, "hang", fault(tmp_path, 1, 7, kind="hang"), 10.0)


def _damage(storage, path: str, how: str) -> None:
    """Damage a stored file as a disk, a partial copy or a person would: its bytes changed
    (same size), cut short, or gone."""
    target = fresh(storage)
    data = target.read_bytes(path)
    if how == "altered":
        target.write_atomic(path, bytes(b ^ 0xFF for b in data[:64]) + data[64:])
    elif how == "truncated":
        target.write_atomic(path, data[: len(data) // 2])
    else:
        target.fs.rm(target.full(path))


@pytest.mark.parametrize("damage", ["altered", "truncated", "missing"])
@pytest.mark.parametrize("storage", ["local", "s3"], indirect=True)
def test_a_damaged_latest_checkpoint_is_dropped_and_the_run_restores_from_the_one_before(
    storage, tmp_path, damage
):
    """A file of the latest checkpoint is damaged on storage after its commit: a restart from
    it fails its manifest's check (size and sha256, or the file's presence). The run drops it
    with a warning, restores from the checkpoint before, and records the failure without
    charging max_failures (0 here)."""
    name = f"damaged-{storage.kind}-{damage}"
    config = demo_config([fault(tmp_path, 1, 8)], checkpoint_every=3)
    with pytest.raises(ft_train.TrainingFailedError):
        train_demo(storage, name, config, max_failures=0)
    state = load_state(storage, name)
    damaged = state.latest
    assert [c.report_index for c in state.checkpoints] == [3, 6], state.checkpoints
    files = Checkpoint(fresh(storage).uri(f"{name}/{damaged}"), storage.options).manifest()["files"]
    _damage(storage, f"{name}/{damaged}/{sorted(files)[0]}", damage)

    result = train_demo(storage, name, config, max_failures=0)
    assert result.status == "finished"
    assert result.last_metrics["resumed_from"] == 3  # not 6, whose files do not match its manifest
    state = load_state(storage, name)
    dropped = state.failures[-1]
    assert not dropped.charged and f"checkpoint {damaged} dropped" in dropped.error, dropped
    found = "is missing" if damage == "missing" else "does not match its manifest"
    assert found in dropped.error, dropped.error
    assert state.attempts[-1].restored_from != damaged
    kept = [c.dir_name for c in RunStore(fresh(storage), name).all_checkpoints(state)]
    assert damaged not in kept and damaged not in fresh(storage).list_dir(name)  # swept
    wait_for(
        lambda: any(e.event == "ft-train.run.finished" for e in events_of(name)),
        30,
        "the run's events to be stored",
    )
    committed = [e.payload["step"] for e in events_of(name) if e.event.endswith("committed")]
    assert committed == [3, 6, 6, 9, 12], committed  # step 3 again, as latest, is no news
    wait_for(
        lambda: any(f"checkpoint {damaged} is damaged" in w for w in _warnings_of(name)),
        30,
        "the warning that the checkpoint is damaged, in the flow run's logs",
    )


def _warnings_of(flow_run_name: str) -> list[str]:
    """The warnings the Prefect API holds for the flow runs named `flow_run_name`."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
        LogFilterLevel,
    )

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name]))
        )
        ids = LogFilterFlowRunId(any_=[r.id for r in runs])
        logs = client.read_logs(LogFilter(flow_run_id=ids, level=LogFilterLevel(ge_=30)))
    return [log.message for log in logs]
