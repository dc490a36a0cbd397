"""The user callbacks' queue and thread (`ft_train.driver.user_callbacks`) and the forms of
`RunConfig.callbacks`, without a run: what the controller's thread pays, what is dropped, what
is logged, what Prefect would store."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from pydantic import Secret

import ft_train
from ft_train.driver.user_callbacks import CallbackThread
from tests.helpers import deadline


class Gated(ft_train.UserCallback):
    """Blocks every call until the test opens the gate; records what it got."""

    def __init__(self):
        self.gate, self.entered = threading.Event(), threading.Event()
        self.got: list[int] = []

    def after_report(self, run_context, metrics, checkpoint, report_index=0):
        self.entered.set()
        self.gate.wait(30)
        self.got.append(report_index)

    def after_run_end(self, run_context, status, error):
        self.gate.wait(30)
        self.got.append(-1)


def _report(thread: CallbackThread, index: int) -> None:
    thread.put(
        "after_report",
        {"run_context": None, "metrics": [], "checkpoint": None, "report_index": index},
        droppable=True,
    )


def test_a_blocked_callback_costs_the_caller_nothing_and_loses_the_oldest_reports_only():
    callback = Gated()
    thread = CallbackThread(callback, max_reports=3)
    _report(thread, 1)
    assert callback.entered.wait(10)  # 1 is being delivered, and blocks
    put_all = threading.Event()

    def caller():  # the controller's thread
        for index in range(2, 9):
            _report(thread, index)
        thread.put("after_run_end", {"run_context": None, "status": "finished", "error": None})
        put_all.set()

    threading.Thread(target=caller, daemon=True).start()
    # the callback stays blocked until the gate opens: a put that waited for it never returns
    assert put_all.wait(10), "a put waited for the blocked callback"
    callback.gate.set()
    assert thread.close(deadline(10)) == 0
    assert callback.got == [1, 6, 7, 8, -1]  # 2..5 dropped, oldest first; the end never
    assert thread.dropped == 4


def test_close_gives_up_on_a_callback_that_never_returns():
    callback = Gated()
    thread = CallbackThread(callback, max_reports=10)
    _report(thread, 1)
    _report(thread, 2)
    assert callback.entered.wait(10)
    # the callback never returns before the deadline (its gate opens after): close gives up
    assert thread.close(deadline(0.3)) == 2  # the one running, and the one queued
    callback.gate.set()


class Raises(ft_train.UserCallback):
    def after_report(self, run_context, metrics, checkpoint):
        raise ValueError("boom")


def test_a_raising_hook_is_logged_once_then_counted(caplog):
    thread = CallbackThread(Raises(), max_reports=10)
    with caplog.at_level(logging.WARNING, logger="ft_train"):
        for _ in range(5):
            thread.put("after_report", {"run_context": None, "metrics": [], "checkpoint": None})
        assert thread.close(deadline(10)) == 0
    logged = [r for r in caplog.records if "Raises.after_report raised ValueError" in r.message]
    assert len(logged) == 1 and thread.errors == {"after_report": 5}
    assert not thread.takes_index  # Ray's signature: report_index is not passed to it


def test_the_three_forms_and_their_credentials_as_prefect_stores_them():
    from fastapi.encoders import jsonable_encoder

    class Mine(ft_train.UserCallback):
        def __init__(self):
            self.password = "planted-in-an-instance"

    run = ft_train.RunConfig(
        name="r",
        callbacks=[
            "ft_train.integrations.mlflow:MLflowCallback",
            {
                "callback": "ft_train.integrations.mlflow:MLflowCallback",
                "kwargs": {
                    "tracking_uri": "https://me:planted-pw@mlflow.example/",
                    "experiment_name": "e",
                    "api_token": "planted-token",
                },
            },
            Mine(),
        ],
    )
    item = run.callbacks[1]
    assert isinstance(item["kwargs"]["api_token"], Secret)
    assert isinstance(item["kwargs"]["tracking_uri"], Secret)  # a URL holding a password
    for encoded in (json.dumps(jsonable_encoder(run)), run.model_dump_json(), repr(run)):
        assert "planted" not in encoded, encoded
    shown = json.loads(run.model_dump_json())["callbacks"]
    assert shown[1]["kwargs"]["experiment_name"] == "e"  # not a credential: shown
    assert shown[2].endswith(
        ":test_the_three_forms_and_their_credentials_as_prefect_stores_them.<locals>.Mine"
    )


@pytest.mark.parametrize(
    "items, says",
    [
        ("a.b:C", "give a list of callbacks"),
        ([42], "a int is not a callback"),
        ([{"callback": "a.b:C", "args": []}], "'args' is not one of its keys"),
        ([{"kwargs": {}}], "a dict item is"),
    ],
)
def test_a_malformed_item_is_refused_naming_it(items, says):
    with pytest.raises(ft_train.ConfigError) as err:
        ft_train.config.parse(ft_train.RunConfig, {"callbacks": items}, "run_config")
    assert "run_config.callbacks" in str(err.value) and says in str(err.value)


def test_trackers_take_the_numbers_of_a_report_flattened():
    from ft_train.callbacks import numbers

    got = numbers({"loss": 0.5, "n": 3, "ok": True, "tag": "x", "val": {"acc": 0.9, "k": {"v": 1}}})
    assert got == {"loss": 0.5, "n": 3.0, "val/acc": 0.9, "val/k/v": 1.0}
