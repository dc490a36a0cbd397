"""A deployment run's `run_config` given in part: the fields it leaves out keep the deployment's.

Prefect replaces a parameter given to a deployment run (`prefect deployment run --param
run_config='{"name": "demo-1"}'`) as a whole: a run config that names only the run would
silently lose the deployment's failure budget and checkpoint retention. In a flow run of a
deployment, `with_deployment_defaults()` merges the run config it was given over the
deployment's own, field by field at every depth (`merge`): a nested config (`failure_config`)
keeps the deployment's fields that the given one does not set, and a dict
(`storage_options`) its keys. A Python call, which has no deployment, is left as it is.
"""

from __future__ import annotations

from typing import Any, TypeVar

from prefect import get_client
from prefect.context import FlowRunContext
from pydantic import BaseModel

import ft_train
from ft_train.config import parse

M = TypeVar("M", bound=BaseModel)


def with_deployment_defaults(run: ft_train.RunConfig) -> ft_train.RunConfig:
    """`run` merged over the deployment's `run_config` parameter, in a flow run of a deployment
    that has one; else `run`."""
    context = FlowRunContext.get()
    flow_run = None if context is None else context.flow_run
    deployment_id = None if flow_run is None else flow_run.deployment_id
    if deployment_id is None:
        return run
    with get_client(sync_client=True) as client:
        defaults = client.read_deployment(deployment_id).parameters.get("run_config")
    if not defaults:
        return run
    return merge(parse(ft_train.RunConfig, defaults, "the deployment's run_config"), run)


def merge(default: M, given: M) -> M:
    """`given` over `default`: each field that `given` set (its `model_fields_set`: what the
    caller wrote, not a default filled in) replaces the default's, except that a nested model is
    merged in turn and a dict key by key."""
    update: dict[str, Any] = {}
    for field in given.model_fields_set:
        value, base = getattr(given, field), getattr(default, field)
        if isinstance(value, BaseModel) and isinstance(base, type(value)):
            value = merge(base, value)
        elif isinstance(value, dict) and isinstance(base, dict):
            value = {**base, **value}
        update[field] = value
    return default.model_copy(update=update)
