"""Failure kinds are one type (`FailureKind`), stored as the strings they always were: a run
state that today's main (f5c7211) wrote, with a failure of every kind (tests/data/
run_state_f5c7211, written by tests/data/make_run_state.py), still loads, resumes and trains on,
and is written back with the same strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ft_train
from ft_train.controller import Controller, Running
from ft_train.driver.prepare import prepare_run
from ft_train.errors import AttemptFailed
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.run_state import STATE_FILE, FailureKind, FailureRecord
from tests.fake_clock import FakeClock
from tests.fake_cluster import FakeCluster, fake_plan

WRITTEN_BY_MAIN = Path(__file__).parent.parent / "data" / "run_state_f5c7211"


def test_a_kind_is_its_string():
    record = FailureRecord(kind="node_loss")
    assert record.kind is FailureKind.NODE_LOSS and record.kind == "node_loss"
    assert json.loads(record.model_dump_json())["kind"] == "node_loss"
    assert f"{record.kind}" == "node_loss"  # in messages, as before
    with pytest.raises(ValueError, match="kind"):
        FailureRecord(kind="oom")


def test_a_run_state_written_by_todays_main_resumes_and_trains_on(tmp_path):
    shutil.copytree(WRITTEN_BY_MAIN, tmp_path / "run")
    written = json.loads((WRITTEN_BY_MAIN / STATE_FILE).read_text())
    run_config = ft_train.RunConfig(name="run", storage_path=str(tmp_path))
    scaling = ft_train.ScalingConfig(num_workers=2)
    plan = prepare_run("tests.loops:report_many", {}, scaling, run_config, log=lambda msg: None)
    try:
        state = plan.state
        assert {f.kind for f in state.failures} == set(FailureKind)  # every kind, read back
        assert all(type(f.kind) is FailureKind for f in state.failures)
        assert state.charged_failures == 4 and state.latest == written["latest"]

        failure_config = ft_train.FailureConfig(max_failures=5)
        manager = CheckpointManager(plan.storage, plan.store, run_config.checkpoint_config)
        ctl = Controller(
            FakeCluster(4),
            fake_plan(plan.storage),
            state,
            plan.store,
            manager,
            failure_config,
            log=lambda msg: None,
            clock=FakeClock(),
        )
        assert isinstance(ctl.step(), Running)
        group = ctl.cluster.group
        assert group.started_from == (written["latest"], written["report_index"])
        assert group.attempt == len(written["attempts"])
        group.raised(1, "ValueError: boom", step=5)
        with pytest.raises(AttemptFailed, match="failure 5 of 5 allowed"):
            ctl.run_segment()  # the old failures count toward the budget as before
    finally:
        plan.release()
    saved = json.loads((tmp_path / "run" / STATE_FILE).read_text())
    assert [f["kind"] for f in saved["failures"]] == [
        *(f["kind"] for f in written["failures"]),
        "exception",
    ]
