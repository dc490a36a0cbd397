"""The demo's parameters are defined once, in `deployments/demo.py`: the `demo` deployment in
`prefect.yaml` (which cannot import Python) repeats them, and `ft-train demo` with no options
trains exactly them. No Prefect, no training: these read files and parse arguments."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from cli import demo as demo_command
from cli.main import build_parser
from deployments import demo
from ft_train.config import ClusterConfig, RunConfig, ScalingConfig

REPO = Path(__file__).resolve().parents[1]


def deployment(name: str) -> dict[str, Any]:
    project = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (found,) = [d for d in project["deployments"] if d["name"] == name]
    return found


def as_json(parameters: dict[str, Any]) -> dict[str, Any]:
    """Flow parameters as a deployment stores them: configs as JSON data."""
    return {
        key: value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        for key, value in parameters.items()
    }


def test_the_demo_deployment_in_prefect_yaml_has_the_demos_parameters():
    """Edit deployments/demo.py and prefect.yaml together: a value in one only fails here."""
    assert deployment("demo")["parameters"] == demo.PARAMETERS
    assert deployment("demo")["entrypoint"] == "flows/train.py:train"


def test_ft_train_demo_without_options_trains_the_demos_parameters():
    args = build_parser().parse_args(["demo"])
    trained = demo_command.flow_parameters(args, args.command_parser)
    validated = {
        **demo.PARAMETERS,
        "scaling_config": ScalingConfig.model_validate(demo.SCALING_CONFIG),
        "run_config": RunConfig.model_validate(demo.RUN_CONFIG),
        "cluster": ClusterConfig.model_validate(demo.CLUSTER),
    }
    assert as_json(trained) == as_json(validated)


def test_an_option_replaces_the_one_parameter_it_names():
    before = copy.deepcopy(demo.PARAMETERS)
    args = build_parser().parse_args(["demo", "--epochs", "1", "--max-failures", "0"])
    trained = as_json(demo_command.flow_parameters(args, args.command_parser))
    assert trained["train_loop_config"] == {**demo.TRAIN_LOOP_CONFIG, "epochs": 1}
    assert trained["run_config"]["failure_config"]["max_failures"] == 0
    assert trained["run_config"]["checkpoint_config"] == RunConfig.model_validate(
        demo.RUN_CONFIG
    ).checkpoint_config.model_dump(mode="json")
    assert demo.PARAMETERS == before  # the one source is read, never written
