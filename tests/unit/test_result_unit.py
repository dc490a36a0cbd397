"""`TrainResult` with Ray's meanings, and the errors a failed run ends with, on a local run
directory built with the library's own commit calls (no Prefect, Dask or socket): `from_path`'s
two forms, `metrics` (the latest checkpoint's) beside `last_metrics`, `best_checkpoints`' order
and length, `get_best_checkpoint`, `WorkerGroupError` rebuilt from the run state, pickling.
"""

from __future__ import annotations

import pathlib
import pickle

import pytest

import ft_train
from ft_train.config import CheckpointConfig, FailureConfig
from ft_train.errors import ConfigError, RankError, TrainingFailedError, WorkerGroupError
from ft_train.policy.failure import final_error
from ft_train.result import TrainResult, split_run_path
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import TRACEBACK_CHARS, FailureRecord, RunState, RunStore

ATTEMPT_ID = "ab" * 16


def build_run(root, name: str, losses: list[float], cfg: CheckpointConfig, tmp_path) -> RunState:
    """A run under `root` with a checkpoint per loss (report indices 1, 2, ...), committed as the
    driver commits, and its checkpoint config recorded as a driver records it."""
    storage = Storage(str(root))
    store = RunStore(storage, name)
    state = RunState(name=name, config={"checkpoint_config": cfg.model_dump(mode="json")})
    for i, loss in enumerate(losses, start=1):
        local = tmp_path / f"upload-{name}-{i}"
        local.mkdir()
        (local / "model.pt").write_bytes(f"weights {i}".encode())
        dir_name = checkpoint_dir_name(i, 0, ATTEMPT_ID)
        files = storage.upload_dir(str(local), f"{name}/{dir_name}")
        CheckpointManager(storage, store, cfg).commit(
            state, dir_name, i, {"loss": loss, "step": i}, files, attempt=0
        )
    return state


def save(root, state: RunState) -> None:
    RunStore(Storage(str(root)), state.name).save(state)


def steps(result: TrainResult) -> list[int]:
    return [m["step"] for _, m in result.best_checkpoints]


# -- from_path's two forms -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, expected",
    [
        ("s3://bucket/prefix/run-1", ("s3://bucket/prefix", "run-1")),
        ("s3://bucket/prefix/run-1/", ("s3://bucket/prefix", "run-1")),  # trailing slash
        ("s3://bucket/run-1", ("s3://bucket", "run-1")),
        ("/data/runs/run-1", ("/data/runs", "run-1")),
        ("/data/runs/run-1/", ("/data/runs", "run-1")),
        (pathlib.PurePosixPath("/data/runs/run-1"), ("/data/runs", "run-1")),  # PathLike
    ],
)
def test_a_runs_path_splits_into_storage_path_and_name(path, expected):
    assert split_run_path(path) == expected


def test_a_relative_path_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert split_run_path("runs/run-1") == (str(tmp_path / "runs"), "run-1")


@pytest.mark.parametrize("path", ["s3://bucket", "s3://bucket/", "/"])
def test_a_path_without_a_run_name_is_refused(path):
    with pytest.raises(ConfigError, match="no run's directory"):
        split_run_path(path)


def test_query_parameters_are_refused_naming_storage_options():
    with pytest.raises(ConfigError, match="storage_options"):
        TrainResult.from_path("s3://bucket/run?endpoint_override=http://localhost:9000")


def test_a_pyarrow_filesystem_is_refused_naming_storage_options(tmp_path):
    fs = object()  # Ray's second argument: a pyarrow filesystem
    with pytest.raises(TypeError, match="storage_options"):
        TrainResult.from_path(str(tmp_path / "run"), fs)
    with pytest.raises(TypeError, match="storage_options"):
        TrainResult.from_path(str(tmp_path / "run"), storage_filesystem=fs)


def test_both_forms_read_the_same_run(tmp_path):
    root = tmp_path / "runs"
    save(root, build_run(root, "both", [0.5, 0.3], CheckpointConfig(), tmp_path))
    by_name = TrainResult.from_path(str(root), "both")
    assert by_name.path == str(root / "both")
    for form in (by_name.path, by_name.path + "/", root / "both"):  # str, trailing /, PathLike
        by_path = TrainResult.from_path(form)
        assert by_path.checkpoint == by_name.checkpoint
        assert by_path.best_checkpoints == by_name.best_checkpoints
        assert by_path.return_value is None  # never stored
    with pytest.raises(ft_train.StorageError, match="no run named 'missing'"):
        TrainResult.from_path(root / "missing")


# -- metrics, best_checkpoints, get_best_checkpoint ----------------------------------------------


def test_metrics_are_the_latest_checkpoints_and_the_last_report_is_last_metrics(tmp_path):
    state = build_run(tmp_path, "run", [0.5, 0.3, 0.4], CheckpointConfig(), tmp_path)
    state.status, state.final_metrics = "finished", {"loss": 0.35, "step": 4}  # no checkpoint
    save(tmp_path, state)
    result = TrainResult.from_path(tmp_path / "run")
    assert result.metrics == {"loss": 0.4, "step": 3}  # Ray's: the latest checkpoint's
    assert result.last_metrics == {"loss": 0.35, "step": 4}
    assert result.checkpoint.path.endswith(checkpoint_dir_name(3, 0, ATTEMPT_ID))


def test_metrics_are_none_without_a_checkpoint(tmp_path):
    state = RunState(name="none", status="finished", final_metrics={"loss": 1.0})
    save(tmp_path, state)
    result = TrainResult.from_path(tmp_path / "none")
    assert result.metrics is None and result.checkpoint is None and result.best_checkpoints == []
    assert result.last_metrics == {"loss": 1.0}
    assert result.get_best_checkpoint("loss", "min") is None


def test_best_checkpoints_are_in_report_order_without_a_score(tmp_path):
    save(tmp_path, build_run(tmp_path, "run", [0.5, 0.1, 0.9, 0.4], CheckpointConfig(), tmp_path))
    assert steps(TrainResult.from_path(tmp_path / "run")) == [1, 2, 3, 4]


def test_best_checkpoints_ascend_by_score_and_stop_at_num_to_keep(tmp_path):
    cfg = CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"
    )
    # The latest (0.9) is kept on storage though not among the 2 best; Ray's list leaves it out.
    save(tmp_path, build_run(tmp_path, "run", [0.5, 0.1, 0.3, 0.9], cfg, tmp_path))
    result = TrainResult.from_path(tmp_path / "run")  # ranked as the run's recorded config says
    assert steps(result) == [3, 2]  # 0.3 then 0.1: the best last
    assert result.checkpoint.path.endswith(checkpoint_dir_name(4, 0, ATTEMPT_ID))
    assert result.metrics == {"loss": 0.9, "step": 4}
    assert result.get_best_checkpoint("loss", "min") == result.best_checkpoints[-1][0]
    assert result.get_best_checkpoint("loss", "max") == result.best_checkpoints[0][0]
    # Another ranking, asked for: the 2 best by max
    by_max = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss")
    assert steps(TrainResult.from_path(tmp_path / "run", checkpoint_config=by_max)) == [3, 4]


def test_get_best_checkpoint_skips_checkpoints_without_the_metric(tmp_path):
    save(tmp_path, build_run(tmp_path, "run", [0.5, 0.1, 0.9], CheckpointConfig(), tmp_path))
    result = TrainResult.from_path(tmp_path / "run")
    result.best_checkpoints[1][1].pop("loss")  # as if step 2 had reported no loss
    assert result.get_best_checkpoint("loss", "min") == result.best_checkpoints[0][0]
    assert result.get_best_checkpoint("loss", "max") == result.best_checkpoints[2][0]
    assert result.get_best_checkpoint("accuracy", "max") is None  # none has it
    with pytest.raises(ConfigError, match="'max' or 'min'"):
        result.get_best_checkpoint("loss", "lowest")


def test_metrics_dataframe_has_a_row_per_kept_checkpoint(tmp_path):
    save(tmp_path, build_run(tmp_path, "run", [0.5, 0.1], CheckpointConfig(), tmp_path))
    result = TrainResult.from_path(tmp_path / "run")
    rows = result.metrics_dataframe.to_dict("records")  # pandas: in the test extra, as Ray has it
    assert len(rows) == 2 and rows == [m for _, m in result.best_checkpoints]
    assert len(result.history_dataframe) == len(result.metrics_history)


def test_filesystem_is_refused_naming_what_to_use(tmp_path):
    save(tmp_path, RunState(name="run"))
    result = TrainResult.from_path(tmp_path / "run")
    with pytest.raises(ConfigError, match="fsspec"):
        _ = result.filesystem
    assert not hasattr(result, "filesystem")


# -- the error of a failed run ---------------------------------------------------------------


def failed_run(kind: str = "exception") -> tuple[RunState, FailureConfig]:
    """A run whose second charged failure spent max_failures=1 (or, for a preemption, whose
    second preemption spent max_preemption_failures=1)."""
    charged = kind != "preemption"
    state = RunState(name="failed")
    state.failures = [
        FailureRecord(kind=kind, rank=1, step=3, error="ValueError: boom", attempt=0,
                      charged=charged, traceback="Traceback ...\nValueError: boom\n"),
        FailureRecord(kind="driver_interrupt", error="KeyboardInterrupt", charged=False, attempt=0),
        FailureRecord(kind=kind, rank=0, step=5, error="KeyError: 'x'", attempt=1,
                      charged=charged, traceback="Traceback ...\nKeyError: 'x'\n"),
    ]  # fmt: skip
    return state, FailureConfig(max_failures=1, max_preemption_failures=1)


def test_the_budget_spent_on_worker_failures_ends_with_workergrouperror():
    state, cfg = failed_run()
    error = final_error(state.failures[-1], state, cfg, start_failures=0)
    assert type(error) is WorkerGroupError and isinstance(error, TrainingFailedError)
    assert "max_failures=1" in str(error) and "ValueError: boom" in str(error)  # every failure
    # Ray's: the last attempt's failures by rank, here rebuilt from the records
    assert error.worker_failures == {0: RankError("KeyError: 'x'", ANY_TB, 0, 5, "exception")}
    failure = error.worker_failures[0]
    assert failure.type_name == "KeyError" and "KeyError: 'x'" in failure.traceback
    assert isinstance(failure, RuntimeError)
    assert len(error.failures) == 3  # every failure since the budget was reset, as JSON


ANY_TB = "Traceback ...\nKeyError: 'x'\n"


def test_a_spent_preemption_budget_is_a_plain_trainingfailederror():
    state, cfg = failed_run("preemption")
    error = final_error(state.failures[-1], state, cfg, start_failures=0)
    assert type(error) is TrainingFailedError and "max_preemption_failures=1" in str(error)


def test_the_result_of_a_failed_run_holds_the_error_the_flow_raised(tmp_path):
    state, cfg = failed_run()
    raised = final_error(state.failures[-1], state, cfg, start_failures=0)
    state.status, state.error, state.error_type = "failed", str(raised), "WorkerGroupError"
    save(tmp_path, state)
    error = TrainResult.from_path(tmp_path / "failed").error
    assert type(error) is WorkerGroupError
    assert str(error) == str(raised) and error.worker_failures == raised.worker_failures
    assert error.failures == raised.failures


def test_errors_survive_pickling_whatever_the_user_raised():
    class Unpicklable(Exception):  # a local class: pickle cannot find it by name
        pass

    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(Unpicklable("boom"))
    state, cfg = failed_run()
    error = final_error(state.failures[-1], state, cfg, start_failures=0)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is WorkerGroupError and str(back) == str(error)
    assert back.worker_failures == error.worker_failures and back.failures == error.failures
    assert back.worker_failures[0].traceback == ANY_TB


def test_a_failure_record_keeps_the_end_of_a_long_traceback():
    text = "x" * (TRACEBACK_CHARS + 10) + "ValueError: boom"
    kept = FailureRecord(kind="exception", traceback=text).traceback
    assert len(kept) == TRACEBACK_CHARS and kept.endswith("ValueError: boom")
