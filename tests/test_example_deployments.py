"""The examples a user copies, as deployments (issue 44): `gpt2-trainer` (Hugging Face
Transformers' Trainer on a tiny GPT-2) and `lightning-digits` (a Lightning module), deployed from
prefect.yaml with `prefect deploy`, run by `prefect deployment run` through a worker of the
process pool, each with a short train_loop_config and a run config given in part (the
deployment's failure budget and preloads are kept). Both runs go at once, on the session's
Prefect server (SQLite). Their `ft-train run` and Python paths, under faults, are
tests/test_transformers.py's and tests/test_lightning.py's."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

import ft_train
from tests.helpers import wait_for
from tests.prefect_e2e import PREFECT, REPO, call, client_env, deployed, tail

pytest.importorskip("transformers")
pytest.importorskip("lightning")

# deployment -> (a short train_loop_config, the reports it makes)
RUNS = {
    # a save every 3 steps: reports at steps 3 and 6
    "gpt2-trainer": ({"max_steps": 6, "save_steps": 3, "logging_steps": 3}, [3, 6]),
    # 1500 images, 32 a batch, 2 ranks: 24 steps an epoch; reports at steps 2 and 4 (the last,
    # at max_steps, is the epoch's end)
    "lightning-digits": ({"max_epochs": 1, "max_steps": 4, "every_n_train_steps": 2}, [2, 4]),
}
DONE = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@pytest.mark.timeout(600)
def test_both_examples_train_to_the_end_as_deployments(prefect_api, tmp_path):
    env = client_env(prefect_api)
    runs = str(tmp_path / "runs")
    with deployed(env, list(RUNS), tmp_path) as worker_log:
        flow_runs = {}
        for deployment, (config, _) in RUNS.items():
            run_config = {"name": f"{deployment}-e2e", "storage_path": runs}
            done = subprocess.run(
                PREFECT
                + ["deployment", "run", f"ft-train/{deployment}"]
                + ["--param", f"run_config={json.dumps(run_config)}"]
                + ["--param", f"train_loop_config={json.dumps(config)}"],
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            match = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
            assert match, done.stdout
            flow_runs[deployment] = match.group(1)

        def state(deployment: str) -> str:
            url = f"{prefect_api}/flow_runs/{flow_runs[deployment]}"
            return call("GET", url, timeout=10).json()["state_type"]

        wait_for(
            lambda: all(state(d) in DONE for d in RUNS),
            timeout_s=480,
            what="both example deployments to finish",
        )
        states = {d: state(d) for d in RUNS}
        assert set(states.values()) == {"COMPLETED"}, f"{states}\n{tail(worker_log, 8000)}"

    for deployment, (_, steps) in RUNS.items():
        result = ft_train.TrainResult.from_path(runs, f"{deployment}-e2e")
        assert result.status == "finished" and result.failures == [], result
        # every report carried the framework's checkpoint; the last at max_steps
        assert [m["step"] for _, m in result.best_checkpoints] == steps, (deployment, result)
