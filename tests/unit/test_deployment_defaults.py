"""A deployment run's run_config given in part keeps the deployment's other fields, at every
depth (`flows.deployment_defaults.merge`, which the flow applies in a deployment's flow run;
tests/test_deployment_e2e.py runs it through a real deployment)."""

from __future__ import annotations

from deployments import demo
from flows.deployment_defaults import merge
from ft_train.config import RunConfig


def test_a_run_config_given_in_part_keeps_the_deployments_other_fields():
    default = RunConfig.model_validate(demo.RUN_CONFIG)
    given = RunConfig.model_validate(
        {
            "name": "demo-1",
            "failure_config": {"max_driver_restarts": 5},
            "storage_options": {"a": 1},
        }
    )
    merged = merge(default, given)
    assert merged.name == "demo-1"
    assert merged.storage_path == default.storage_path
    assert (
        merged.checkpoint_config.num_to_keep == demo.RUN_CONFIG["checkpoint_config"]["num_to_keep"]
    )
    assert merged.failure_config.max_failures == demo.RUN_CONFIG["failure_config"]["max_failures"]
    assert merged.failure_config.max_driver_restarts == 5
    assert merged.storage_options == {"a": 1}


def test_what_the_run_config_sets_wins_even_where_it_equals_a_default():
    """A field given at its class default (max_failures=0) is given: it replaces the
    deployment's 1, as the user wrote it."""
    default = RunConfig.model_validate(demo.RUN_CONFIG)
    given = RunConfig.model_validate({"failure_config": {"max_failures": 0}, "name": None})
    merged = merge(default, given)
    assert merged.failure_config.max_failures == 0
    assert merged.name is None  # given as null: the flow run generates one
    assert merge(default, default) == default
