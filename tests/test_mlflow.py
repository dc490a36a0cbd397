"""Trackers as driver-side callbacks, against real stores: MLflow on SQLite and TensorBoard's
event files. A run whose rank is killed, then whose driver is killed (SIGKILL of the flow
process) and rerun by name, leaves one MLflow run: each report index once in every metric's
history, the parameters, both failures, the checkpoints and the end status; and event files that
hold each report index once."""

from __future__ import annotations

import os
import signal

import pytest

import ft_train
from tests.conftest import StorageTarget
from tests.helpers import REPO, load_state, start_driver_process, wait_for

pytest.importorskip("mlflow")  # the [mlflow] extra, which the test extra pins
pytest.importorskip("tensorboard")

STEPS, EVERY = 20, 5
EXPERIMENT = "ft-train-tests"


def test_one_tracked_run_across_a_killed_rank_and_a_killed_driver(tmp_path, prefect_api):
    from mlflow import MlflowClient

    storage = StorageTarget("local", str(tmp_path / "runs"))
    db, tb = f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "tb")
    client = MlflowClient(db)
    client.search_experiments()  # the store's tables, made before two drivers share it
    kill = {"rank": 1, "step": 7, "kind": "kill", "marker": str(tmp_path / "kill")}
    hold = {"rank": 0, "step": 12, "kind": "wait", "marker": str(tmp_path / "hold")}
    config = {"steps": STEPS, "every": EVERY, "faults": [kill, hold], "step_s": 0.02}
    callbacks = [
        {
            "callback": "ft_train.integrations.mlflow:MLflowCallback",
            "kwargs": {"tracking_uri": db, "experiment_name": EXPERIMENT},
        },
        {
            "callback": "ft_train.integrations.tensorboard:TensorBoardCallback",
            "kwargs": {"log_dir": tb},
        },
    ]
    args = {
        "repo": REPO,
        "name": "tracked",
        "config": config,
        "storage_path": storage.path,
        "storage_options": {},
        "train_loop": "tests.loops:fast_checkpoints",
        "max_failures": 1,
        "callbacks": callbacks,
    }
    log = tmp_path / "driver.log"
    driver = start_driver_process(args, prefect_api, log)
    try:
        # rank 1 killed at step 7, restarted from step 5; rank 0 then holds at step 12, after
        # the checkpoint at 10, until the driver is killed
        wait_for(lambda: os.path.exists(hold["marker"]), 400, "rank 0 to hold at step 12")
        # the gate hands report 12 over; the driver commits checkpoint 10 on its own time
        wait_for(lambda: load_state(storage, "tracked").report_index == 10, 120, "checkpoint 10")
        state = load_state(storage, "tracked")
        assert [f.kind for f in state.failures] == ["process_death"]
        wait_for(lambda: _logged_upto(client) == 12, 120, "MLflow to hold report 12")
        # each callback has a thread of its own: TensorBoard's may lag behind (its first call
        # imports it); a driver killed before it took report 10 would lose what it queued
        wait_for(lambda: _written_upto(tb) >= 10, 120, "TensorBoard to hold report 10")
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert load_state(storage, "tracked").status == "running", log.read_text()[-3000:]

    from flows.train import train

    result = train(
        train_loop="tests.loops:fast_checkpoints",
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name="tracked",
            storage_path=storage.path,
            failure_config=ft_train.FailureConfig(max_failures=1),
            callbacks=callbacks,
        ),
    )
    assert result.status == "finished"
    assert [f.kind for f in result.failures] == ["process_death", "driver_crash"]

    [run] = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    run_id, tags = run.info.run_id, run.data.tags
    assert run.info.status == "FINISHED" and tags["ft_train.status"] == "finished"
    assert tags["ft_train.run_path"] == result.path and tags["ft_train.driver_runs"] == "2"
    # Each report index once, in every metric: every index from the first checkpoint's on
    # (those after it are trained again after a restart); before it, those that reached the
    # driver (reports still queued on rank 1 when it was killed may die with it: then they are
    # in no history, ft-train's own included).
    tracked = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert len(set(tracked)) == len(tracked), tracked
    assert set(range(EVERY, STEPS + 1)) <= set(tracked) <= set(range(1, STEPS + 1)), tracked
    for key in ("step", "resumed_from"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == tracked, key
    # reports 11 and 12, logged before the driver's kill, were trained again (and 6, 7 after
    # the rank's, where they had reached the driver)
    assert 2 <= int(tags["ft_train.reports_trained_again"]) <= 4
    assert run.data.params["steps"] == str(STEPS) and run.data.params["every"] == str(EVERY)
    assert tags["ft_train.failures"] == "2"
    assert tags["ft_train.failure.1"].startswith("process_death on rank 1")
    assert tags["ft_train.failure.2"].startswith("driver_crash")
    for index in range(EVERY, STEPS + 1, EVERY):
        assert tags[f"ft_train.checkpoint.{index}"].startswith(result.path + "/checkpoint_")
    assert tags["ft_train.latest_checkpoint"] == result.checkpoint.path

    # TensorBoard: every report index once in the run's event files (read as they are, not
    # with the reader's own clean-up of a restart's events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        os.path.join(tb, "tracked"), size_guidance={"scalars": 0}, purge_orphaned_data=False
    )
    events.Reload()
    for key in ("loss", "step"):
        steps = [e.step for e in events.Scalars(key)]
        assert sorted(steps) == tracked, (key, sorted(steps))


def _logged_upto(client) -> int:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    if not runs:
        return 0
    return max((m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")), default=0)


def _written_upto(tb: str) -> int:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(os.path.join(tb, "tracked")):
        return 0
    events = EventAccumulator(
        os.path.join(tb, "tracked"), size_guidance={"scalars": 0}, purge_orphaned_data=False
    )
    events.Reload()
    if "loss" not in events.Tags()["scalars"]:
        return 0
    return max((e.step for e in events.Scalars("loss")), default=0)
