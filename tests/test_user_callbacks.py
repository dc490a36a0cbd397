"""Driver-side user callbacks (`RunConfig.callbacks`) on a real run: they see every report,
checkpoint, failure and the end; a callback that blocks 5 s a call delays neither recovery nor
the reports; one that raises does not fail the run; a path that does not import is refused
before anything starts; a token in a callback's kwargs is stored nowhere by Prefect nor under
the run's storage."""

from __future__ import annotations

import hashlib
import logging
import os
import re

import pytest

import ft_train
from ft_train import knobs
from ft_train.storage.fs import Storage
from tests.callback_kinds import RayStyle, Recorder, read_jsonl
from tests.conftest import StorageTarget
from tests.helpers import load_state, stored_by_prefect

STEPS, EVERY = 40, 5
TOKEN = "planted-callback-token-7f3a"
PASSWORD = "planted-callback-password-91c2"


def _train(path: str, name: str, callbacks: list, faults: list, step_s: float):
    from flows.train import train

    return train(
        train_loop="tests.loops:fast_checkpoints",
        train_loop_config={"steps": STEPS, "every": EVERY, "faults": faults, "step_s": step_s},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=path,
            failure_config=ft_train.FailureConfig(max_failures=1),
            callbacks=callbacks,
        ),
    )


def _timings(path: str, name: str) -> tuple[float, float]:
    """(recovery: the failure seen to the next attempt's start; the restarted attempt's
    reports per second, from its start to its last commit), from the run state."""
    state = load_state(StorageTarget("local", path), name)
    assert state.status == "finished" and len(state.attempts) == 2
    recovery = (state.attempts[1].started_at - state.failures[0].time).total_seconds()
    last = max(c.committed_at for c in state.checkpoints)
    trained = STEPS - state.attempts[1].start_report_index
    return recovery, trained / (last - state.attempts[1].started_at).total_seconds()


@pytest.mark.parametrize("step_s", [0.003, 0.1], ids=["3ms-steps", "100ms-steps"])
def test_slow_and_raising_callbacks_change_nothing_and_see_everything(
    tmp_path, prefect_api, monkeypatch, step_s
):
    path = str(tmp_path / "runs")
    kill = {"rank": 1, "step": 13, "kind": "kill"}
    # names of their own per parameter: the session's Prefect API holds every test's flow runs
    baseline, watched = f"baseline-{step_s * 1000:.0f}ms", f"watched-{step_s * 1000:.0f}ms"
    base = _train(path, baseline, [], [{**kill, "marker": str(tmp_path / "k0")}], step_s)
    assert base.status == "finished"

    monkeypatch.setattr(knobs, "CALLBACK_DRAIN_S", 1.0)  # the slow one is left behind at the end
    recorder, ray_style, jsonl = Recorder(), RayStyle(), str(tmp_path / "recorded.jsonl")
    callbacks = [
        "tests.callback_kinds:Slow",  # an import path: 5 s in every call
        {"callback": "tests.callback_kinds:Raising", "kwargs": {"token": TOKEN}},
        {
            "callback": "tests.callback_kinds:Recorder",
            "kwargs": {"path": jsonl, "token": TOKEN, "uri": f"http://me:{PASSWORD}@mlflow:5000"},
        },
        recorder,  # instances, in a Python call
        ray_style,
    ]
    logged = _Kept()  # the ft_train logger's records (Prefect's logging config stops propagation)
    logging.getLogger("ft_train").addHandler(logged)
    try:
        result = _train(
            path, watched, callbacks, [{**kill, "marker": str(tmp_path / "k1")}], step_s
        )
    finally:
        logging.getLogger("ft_train").removeHandler(logged)
    assert result.status == "finished" and result.metrics["step"] == STEPS

    # Neither recovery nor the reports waited for the callbacks (a generous bound: one 5 s
    # call on the controller's thread would break either).
    (base_recovery, base_rate), (recovery, rate) = (
        _timings(path, baseline),
        _timings(path, watched),
    )
    assert recovery < 2 * base_recovery + 2.0, (recovery, base_recovery)
    assert rate > base_rate / 3, (rate, base_rate)

    # The one that raises: logged once per hook, and the run finished.
    raised = [m for m in logged.messages if "Raising." in m]
    for hook in ("after_report", "after_checkpoint", "after_exception", "after_failure"):
        assert sum(f"Raising.{hook} raised RuntimeError" in m for m in raised) == 1, raised
    assert any(re.search(r"Raising\.after_report raised \d+ times", m) for m in raised), raised

    # What the recorder saw: every report index, with every rank's metrics; each checkpoint
    # before its report; the killed rank; the end. Reports still queued on rank 1 when it was
    # killed (they travel in batches, `knobs.REPORT_BATCH_S`) die with it: a round before the
    # restore point (10), checkpoint 5's included, may be missing, as from the run's history
    # (at 3 ms a step, rank 1 is killed before its first batch goes).
    restore = 2 * EVERY
    reports = recorder.hooks("after_report")
    indices = [r["index"] for r in reports]
    missing = set(range(1, STEPS + 1)) - set(indices)
    assert all(i < restore for i in missing), sorted(missing)
    assert set(indices) <= set(range(1, STEPS + 1))
    assert all(indices.count(i) <= 1 for i in range(1, restore + 1))  # up to the restore point
    assert all(indices.count(i) == 1 for i in range(14, STEPS + 1))  # after the failure
    # every rank's metrics; the restore point's round, recovered from the ranks' journals, may
    # have only those whose message survived the kill
    assert {r["ranks"] for r in reports if r["index"] != restore} == {2}
    assert {r["path"] for r in reports} == {result.path}
    committed = [c["index"] for c in recorder.hooks("after_checkpoint")]
    assert sorted(set(committed)) in (
        list(range(EVERY, STEPS + 1, EVERY)),
        list(range(restore, STEPS + 1, EVERY)),
    ), committed
    with_ckpt = [r for r in reports if r["checkpoint"]]
    assert [r["index"] for r in with_ckpt] == committed
    order = [(h, a.get("index")) for h, a in recorder.calls]
    assert order.index(("after_checkpoint", restore)) < order.index(("after_report", restore))
    [exception] = recorder.hooks("after_exception")
    assert list(exception["errors"]) == [1] and "RankError" in exception["errors"][1]
    [failure] = recorder.hooks("after_failure")
    assert failure["kind"] == "process_death" and failure["left"] == 0
    assert recorder.hooks("after_run_end") == [
        {"status": "finished", "error": None, "at": recorder.hooks("after_run_end")[0]["at"]}
    ]
    # Ray's signatures work as Ray calls them
    assert ray_style.reports == [r["ranks"] for r in reports]
    assert [list(e) for e in ray_style.exceptions] == [[1]]

    # The dict form got its kwargs, credentials included (their hashes show it)...
    lines = read_jsonl(jsonl)
    assert lines and lines[-1]["hook"] == "after_run_end"
    assert lines[0]["sha"]["token"] == _sha(TOKEN)
    assert lines[0]["sha"]["uri"] == _sha(f"http://me:{PASSWORD}@mlflow:5000")
    # ... which Prefect stored nowhere (parameters, task runs, logs, artifacts, events), nor
    # the run's storage.
    planted = (TOKEN, PASSWORD)
    for where, text in stored_by_prefect([watched]).items():
        assert not any(p in text for p in planted), where
    runs = Storage(path)
    for file in runs.fs.find(path):
        assert not any(p.encode() in runs.fs.cat(file) for p in planted), file


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    "item, says",
    [
        ("no_such_module_for_ft:Callback", "module 'no_such_module_for_ft' does not import"),
        ("tests.callback_kinds:NotACallback", "not a subclass of ft_train.UserCallback"),
        ("tests.callback_kinds:Missing", "names nothing"),
        (
            {"callback": "tests.callback_kinds:Recorder", "kwargs": {"nope": 1, "path": 2}},
            "fix the kwargs",
        ),
        ("tests.callback_kinds", "give an import path 'pkg.mod:Callback'"),
    ],
    ids=["no-module", "not-a-callback", "no-such-name", "bad-kwargs", "no-colon"],
)
def test_a_callback_that_cannot_be_made_is_refused_before_anything_starts(tmp_path, item, says):
    path = str(tmp_path / "runs")
    # ConfigError from the flow's check; a malformed item already when RunConfig is built
    with pytest.raises((ft_train.ConfigError, ValueError)) as err:
        _train(path, "refused", [item], [], 0.0)
    assert "run_config.callbacks[0]" in str(err.value) and says in str(err.value)
    assert not os.path.exists(path)  # nothing was written: no worker, no run


def test_run_config_callbacks_in_a_deployment_schema_refuse_credentials():
    """The flow's parameter schema: Prefect's server refuses a deployment run whose callback
    kwargs hold a credential, before it stores it."""
    from prefect.utilities.schema_tools.validation import validate

    from flows.train import train

    schema = train.parameters.model_dump()
    item = {"callback": "ft_train.integrations.mlflow:MLflowCallback", "kwargs": {}}
    ok = {"train_loop": "m:f", "run_config": {"name": "r", "callbacks": ["a.b:C", item]}}
    validate(ok, schema, raise_on_error=True)
    ok_url = {**item, "kwargs": {"tracking_uri": "http://mlflow:5000"}}
    validate({**ok, "run_config": {"name": "r", "callbacks": [ok_url]}}, schema, True)
    for kwargs, says in [
        ({"tracking_token": "x"}, "tracking_token"),
        ({"tracking_uri": f"http://me:{PASSWORD}@mlflow:5000"}, "should not be valid"),
    ]:
        bad = {**item, "kwargs": kwargs}
        with pytest.raises(Exception, match=says):
            validate(
                {"train_loop": "m:f", "run_config": {"name": "r", "callbacks": [bad]}},
                schema,
                raise_on_error=True,
            )
