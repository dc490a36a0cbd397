"""Automatic driver recovery for ft-train deployments: two Prefect automations per deployment,
installed by `ft-train automations install` (or `install()` here) against a Prefect server.

- `ft-train-rerun/<deployment>` (reactive): a flow run of the deployment that ends Crashed
  starts a new run of it with the same parameters, its `run_config.name` the crashed run's own
  name (a scheduled run's rendered template, or the name generated for a run given none), so
  the new driver resumes the run by name from its latest checkpoint. Crashed: the worker saw
  the flow process die (SIGKILL, the OOM killer), or the zombie automation below marked it so.
  Not rerun:
  - a crash before the flow ran (its run count is 0: code missing, a bad import; a rerun would
    crash the same way);
  - a flow run that a driver which took the run over marked Crashed (`tasks.train.TAKEN_OVER`):
    that driver trains the run already.
  Reruns are bounded by the run state, not here: each driver that finds its predecessor crashed
  records it, and past `failure_config.max_driver_restarts` it fails the run (Failed, which this
  automation does not rerun).
- `ft-train-zombies/<deployment>` (proactive): a flow run of the deployment that sent a
  heartbeat and then no event for `within` is marked Crashed (its machine or worker is gone, and
  nothing else would report it), which the rerun automation then sees. Flow-run processes send a
  heartbeat every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (Prefect's default 180, minimum 30;
  prefect.yaml sets 30). Give `within` as three heartbeats or more: one late heartbeat (a busy
  machine, a slow API) must not crash a live run. Proactive triggers run on `prefect server
  start`, not on the ephemeral server.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, RunDeployment
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

from tasks.train import TAKEN_OVER

FLOW = "ft-train"
HEARTBEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY in prefect.yaml's work pool
MISSED_HEARTBEATS = 3

# The crashed run's parameters, as Prefect's automation templates render them (one expression
# each: a dict stays a dict). The name: the flow names its run after the rendered run name.
RERUN_PARAMETERS = {
    "train_loop": "{{ flow_run.parameters['train_loop'] }}",
    "train_loop_config": "{{ flow_run.parameters.get('train_loop_config') }}",
    "run_config": "{{ dict(flow_run.parameters['run_config'], name=flow_run.name) }}",
    "scaling_config": "{{ flow_run.parameters.get('scaling_config', {}) }}",
    "cluster": "{{ flow_run.parameters.get('cluster', {}) }}",
}


def rerun_crashed(deployment_id: UUID, name: str) -> AutomationCore:
    """The automation that reruns a crashed flow run of the deployment (see the module)."""
    return AutomationCore(
        name=f"ft-train-rerun/{name}",
        description="Rerun a crashed ft-train driver; it resumes the run by name.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={
                "prefect.resource.id": "prefect.flow-run.*",
                "prefect.run-count": "!0",  # it crashed before the flow ran: a rerun would too
                "prefect.state-message": f"!{TAKEN_OVER}*",  # another driver trains the run
            },
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            RunDeployment(
                source="selected", deployment_id=deployment_id, parameters=RERUN_PARAMETERS
            )
        ],
    )


def crash_zombies(deployment_id: UUID, name: str, within: timedelta) -> AutomationCore:
    """The automation that marks a flow run of the deployment Crashed when its heartbeats stop."""
    return AutomationCore(
        name=f"ft-train-zombies/{name}",
        description=f"Mark an ft-train driver Crashed after {within} without a heartbeat.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.*"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within.total_seconds():g}s: its driver is gone",
            )
        ],
    )


def install(
    deployments: Sequence[str] = (),
    within: timedelta = timedelta(seconds=MISSED_HEARTBEATS * HEARTBEAT_S),
) -> list[str]:
    """Create (or replace) both automations for each deployment ('ft-train/demo'), by default
    every deployment of the ft-train flow; the names of those installed. Needs a Prefect server
    (PREFECT_API_URL): an ephemeral one would forget them, and runs no proactive trigger."""
    if within < timedelta(seconds=60):
        raise ValueError(
            f"within={within.total_seconds():g}s is under two heartbeats' minimum (30 s each): "
            "give at least 3 x PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
        )
    installed = []
    with get_client(sync_client=True) as client:
        if deployments:
            found = [(d, client.read_deployment_by_name(d)) for d in deployments]
        else:
            of_flow = FlowFilter(name=FlowFilterName(any_=[FLOW]))
            found = [(f"{FLOW}/{d.name}", d) for d in client.read_deployments(flow_filter=of_flow)]
        for name, deployment in found:
            for automation in (
                rerun_crashed(deployment.id, name),
                crash_zombies(deployment.id, name, within),
            ):
                for old in client.read_automations_by_name(automation.name):
                    client.delete_automation(old.id)
                client.create_automation(automation)
                installed.append(automation.name)
    return installed
