"""Driver recovery without a server: the driver-restart budget kept in the run state, run-name
templates for scheduled runs, and what the recovery automations match (Prefect's own server-side
trigger matching, on the events Prefect's server emits). `tests/test_recovery_e2e.py` runs them
all against `prefect server start` with a worker."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import jsonschema
import pytest
from prefect.server.events.schemas.automations import EventTrigger as ServerTrigger
from prefect.server.events.schemas.events import ReceivedEvent

import ft_train
from deployments.automations import crash_zombies, rerun_crashed
from ft_train.driver import prepare
from ft_train.errors import ConfigError, TrainingFailedError
from ft_train.run_name import render
from ft_train.storage.run_state import RunStore
from tasks.train import TAKEN_OVER
from tests.conftest import on_storage
from tests.helpers import deployment, foreign_lease, fresh

# -- the driver-restart budget -------------------------------------------------------------


def start_driver(target, name: str, max_driver_restarts: int) -> prepare.RunPlan:
    failure = ft_train.FailureConfig(max_failures=0, max_driver_restarts=max_driver_restarts)
    return prepare.prepare_run(
        "tests.loops:report_many",
        {},
        ft_train.ScalingConfig(),
        ft_train.RunConfig(name=name, storage_path=target.path, failure_config=failure),
        log=lambda msg: None,
    )


def killed(target, name: str, plan: prepare.RunPlan) -> None:
    """The driver of `plan` dies: its lease stays as a driver on a machine that is gone left it
    (not released, last renewed long ago), and its run state says running."""
    plan.lease._stop.set()  # its renewals stop, as the process's would
    foreign_lease(target, name, ttl_s=1.0, age_s=60.0)


@on_storage("local")
def test_driver_crashes_past_the_budget_fail_the_run_and_a_rerun_by_hand_counts_afresh(storage):
    name = "crashy"
    plan = start_driver(storage, name, max_driver_restarts=2)
    for _ in range(2):  # two crashes: within the budget, each recorded uncharged
        killed(storage, name, plan)
        plan = start_driver(storage, name, max_driver_restarts=2)
    state = RunStore(fresh(storage), name).load()
    assert [(f.kind, f.charged) for f in state.failures] == [("driver_crash", False)] * 2
    assert state.status == "running"

    killed(storage, name, plan)  # the third crash spends it: this driver fails the run
    with pytest.raises(TrainingFailedError, match=r"max_driver_restarts=2 \(run_config") as err:
        start_driver(storage, name, max_driver_restarts=2)
    assert "crashed 3 times" in str(err.value)
    state = RunStore(fresh(storage), name).load()
    assert state.status == "failed" and "max_driver_restarts" in state.error
    assert state.charged_failures == 0  # max_failures=0 is not spent by driver crashes
    result = ft_train.TrainResult.from_path(storage.path, name)
    assert result.status == "failed" and str(result.error) == state.error

    # A person reruns the failed run: it trains again, with a fresh budget.
    plan = start_driver(storage, name, max_driver_restarts=2)
    assert plan.state.status == "running"
    killed(storage, name, plan)
    plan = start_driver(storage, name, max_driver_restarts=2)
    plan.release()


@on_storage("local")
def test_unlimited_driver_restarts(storage):
    plan = start_driver(storage, "unlimited", max_driver_restarts=-1)
    for _ in range(5):
        killed(storage, "unlimited", plan)
        plan = start_driver(storage, "unlimited", max_driver_restarts=-1)
    plan.release()
    assert len(RunStore(fresh(storage), "unlimited").load().failures) == 5


@on_storage("local")
def test_a_driver_that_ended_is_no_crash(storage):
    plan = start_driver(storage, "clean", max_driver_restarts=0)
    plan.release()  # a driver that ended (Ctrl+C, a failure) released its lease
    start_driver(storage, "clean", max_driver_restarts=0).release()
    assert RunStore(fresh(storage), "clean").load().failures == []


# -- run-name templates ---------------------------------------------------------------------


def test_a_template_renders_from_the_scheduled_start_in_utc():
    slot = datetime(2026, 12, 3, 4, 5, 6, tzinfo=UTC)
    assert render("nightly-{scheduled_start:%Y%m%d-%H%M}", slot) == "nightly-20261203-0405"
    assert render("n-{scheduled_start}", slot) == "n-20261203-040506"
    assert render("plain", slot) == "plain"
    elsewhere = slot.astimezone(__import__("zoneinfo").ZoneInfo("America/New_York"))
    assert render("{scheduled_start:%H}", elsewhere) == "04"


@pytest.mark.parametrize(
    "name", ["nightly-{scheduled_start:%Y%m%d-%H%M}", "{scheduled_start}", "demo", "a=b,c@d:e"]
)
def test_names_and_templates_are_accepted_in_python_and_by_the_deployment_schema(name):
    assert ft_train.RunConfig(name=name).name == name
    jsonschema.validate(name, _name_schema())


@pytest.mark.parametrize(
    "name",
    [
        "nightly-{date}",  # only scheduled_start
        "x/{scheduled_start:%Y/%m}",  # renders a '/': out of the storage path's directory
        "{scheduled_start:..}",
        "-{scheduled_start}",
    ],
)
def test_a_bad_template_is_refused_naming_the_field_and_the_fix(name):
    with pytest.raises(ConfigError, match=r"run_config\.name .*scheduled_start:FORMAT"):
        ft_train.config.parse(ft_train.RunConfig, {"name": name}, "run_config")


def _name_schema() -> dict:
    return ft_train.RunConfig.model_json_schema()["properties"]["name"]


# -- what the automations match ---------------------------------------------------------------

DEPLOYMENT = uuid.uuid4()


def crashed_event(run_count: int, message: str, deployment=DEPLOYMENT, state="Crashed"):
    """A flow-run state event as Prefect's server emits it (`server/models/events.py`)."""
    run = uuid.uuid4()
    return ReceivedEvent(
        occurred=datetime.now(UTC),
        event=f"prefect.flow-run.{state}",
        resource={
            "prefect.resource.id": f"prefect.flow-run.{run}",
            "prefect.resource.name": "nightly-20261203-0300",
            "prefect.run-count": str(run_count),
            "prefect.state-message": message,
            "prefect.state-name": state,
            "prefect.state-type": state.upper(),
        },
        related=[
            {
                "prefect.resource.id": f"prefect.deployment.{deployment}",
                "prefect.resource.role": "deployment",
                "prefect.resource.name": "nightly",
            },
            {"prefect.resource.id": "prefect.tag.ft-train", "prefect.resource.role": "tag"},
        ],
        id=uuid.uuid4(),
    )


def server_trigger(automation) -> ServerTrigger:
    return ServerTrigger.model_validate(automation.trigger.model_dump(mode="json"))


def test_the_rerun_automation_matches_a_crashed_driver_only():
    rerun = server_trigger(rerun_crashed(DEPLOYMENT, "ft-train/nightly"))
    worker_saw_it_die = "Flow run infrastructure exited with non-zero status code -9."
    assert rerun.covers(crashed_event(1, worker_saw_it_die))
    assert rerun.covers(crashed_event(1, ""))
    assert rerun.covers(crashed_event(1, "no heartbeat for 90s: its driver is gone"))
    # not: the flow never ran (its code is missing, an import fails): a rerun would crash too
    assert not rerun.covers(crashed_event(0, worker_saw_it_die))
    # not: a driver that took the run over marked it so; that driver trains the run
    assert not rerun.covers(crashed_event(2, f"{TAKEN_OVER} its driver (pid 7 on h) was gone"))
    # not: another deployment's, or a run that failed (the restart budget spent, a bad config)
    assert not rerun.covers(crashed_event(1, worker_saw_it_die, deployment=uuid.uuid4()))
    assert not rerun.covers(crashed_event(1, "max_driver_restarts", state="Failed"))


def test_the_zombie_automation_watches_each_flow_run_of_the_deployment_for_heartbeats():
    within = timedelta(seconds=90)
    automation = crash_zombies(DEPLOYMENT, "ft-train/nightly", within)
    zombie = server_trigger(automation)
    assert zombie.posture == "Proactive" and zombie.within == within
    assert zombie.after == {"prefect.flow-run.heartbeat"}
    assert zombie.for_each == {"prefect.resource.id"}  # each flow run on its own
    assert zombie.covers(crashed_event(1, "", state="Running"))
    assert not zombie.covers(crashed_event(1, "", deployment=uuid.uuid4(), state="Running"))
    (action,) = automation.actions
    assert action.state == "CRASHED" and re.search(r"no heartbeat for 90s", action.message)


# -- prefect.yaml -------------------------------------------------------------------------------


def test_prefect_yaml_schedules_a_nightly_demo_and_limits_each_deployment_to_one_driver():
    from prefect.server.schemas.schedules import CronSchedule

    from deployments import demo

    nightly = deployment("nightly")
    assert {**nightly["parameters"], "run_config": demo.RUN_CONFIG} == demo.PARAMETERS
    template = nightly["parameters"]["run_config"]["name"]
    slot = datetime(2026, 12, 3, 3, 0, tzinfo=UTC)
    assert render(template, slot) == "nightly-20261203-0300"
    (schedule,) = nightly["schedules"]
    assert schedule["active"] is False  # created off; turned on by a person
    cron = CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])
    assert cron.cron == "0 3 * * *"
    for name in ("demo", "nightly"):
        d = deployment(name)
        assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
        env = d["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"  # what --within 90 assumes
