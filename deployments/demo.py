"""The demo's flow parameters, once: an MLP on scikit-learn's digits, data-parallel over 2 CPU
ranks on a local Dask cluster, stored under the default storage path.

Plain data, as a deployment holds its parameters (JSON: lists, not tuples), in the shape of the
`ft-train` flow's parameters. Three places read or mirror them:
- `ft-train demo` (`cli/demo.py`): its options' defaults are these values;
- the tests (`tests/helpers.py`, `tests/conftest.py`), which pass their own overrides (1 epoch,
  a failure budget of 0) where a test wants a shorter or stricter run;
- the `demo` deployment in `prefect.yaml`, which cannot import Python: it repeats them, and
  `tests/test_deployments.py` fails when the two differ.
"""

from __future__ import annotations

from typing import Any

from ft_train.config import DEFAULT_STORAGE_PATH

TRAIN_LOOP = "ft_train.examples.digits:train_loop"

TRAIN_LOOP_CONFIG: dict[str, Any] = {"epochs": 4, "checkpoint_every": 5}

SCALING_CONFIG: dict[str, Any] = {"num_workers": 2}

RUN_CONFIG: dict[str, Any] = {
    "name": "demo",
    # where `ft-train status` and `ft-train list` look by default
    "storage_path": DEFAULT_STORAGE_PATH,
    "failure_config": {"max_failures": 1},
    "checkpoint_config": {"num_to_keep": 2},
}

# What the demo's ranks import beyond torch (scikit-learn, for its data: 1.7 s on 2 cores): the
# workers' fork server imports it once, so the fresh processes that replace a failed group's have
# it at once.
CLUSTER: dict[str, Any] = {"preload": ["ft_train.examples.digits", "sklearn.datasets"]}

PARAMETERS: dict[str, Any] = {
    "train_loop": TRAIN_LOOP,
    "train_loop_config": TRAIN_LOOP_CONFIG,
    "run_config": RUN_CONFIG,
    "scaling_config": SCALING_CONFIG,
    "cluster": CLUSTER,
}
