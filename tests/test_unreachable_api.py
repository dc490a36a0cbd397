"""PREFECT_API_URL set, its server down (a port with nothing listening, as after `prefect server
start` was stopped): every way in that needs Prefect fails at once, in one line that names the
setting, its value and the two fixes, with a non-zero exit, and starts nothing; `ft-train status`
and `list` read storage only and keep working. Child processes, as a user runs them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])
FIXES = "start that server (prefect server start), or "


@pytest.fixture(scope="module")
def dead_api():
    """An API URL on a loopback port that is bound (no one else takes it) but not listening: a
    connection is refused at once, as by a stopped server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/api"


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A user's environment: a Prefect home of their own, no PREFECT_* settings but telemetry's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PYTHONPATH=REPO,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        TMPDIR=str(tmp_path),
    )
    return env


def run(env: dict[str, str], cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def test_every_command_that_needs_prefect_says_so_in_one_line(env, dead_api, tmp_path):
    """From the environment: the fix is to unset it. `demo`, `run` and `automations install`;
    then `status` and `list`, which do not need Prefect."""
    env = {**env, "PREFECT_API_URL": dead_api}
    store = str(tmp_path / "runs")
    expected = (
        f"error: the Prefect API at PREFECT_API_URL={dead_api} (set in the environment) cannot "
        f"be reached ([Errno 111] Connection refused): {FIXES}unset PREFECT_API_URL to have "
        "Prefect start a temporary server"
    )
    for command in (
        ["demo", "--storage-path", store, "--epochs", "1"],
        ["run", "tests.loops:report_many", "--name", "r", "--storage-path", store],
        ["automations", "install"],
    ):
        done = run(env, tmp_path, "-m", "cli", *command)
        assert (done.returncode, done.stdout) == (1, expected + "\n"), command
    assert not os.path.exists(store)  # nothing started, nothing stored

    listed = run(env, tmp_path, "-m", "cli", "list", "--storage-path", store)
    assert listed.returncode == 0 and listed.stdout == f"no runs under {store}\n", listed.stdout
    shown = run(env, tmp_path, "-m", "cli", "status", "demo", "--storage-path", store)
    assert shown.returncode == 1, shown.stdout
    assert shown.stdout == f"error: no run named 'demo' under {store}\n", shown.stdout


PYTHON_CALLS = """
import sys, ft_train
from flows.api import PrefectApiUnreachable
from flows.train import train
from ft_train.torch import TorchTrainer

params = dict(train_loop="tests.loops:report_many", train_loop_config={"n": 3},
              run_config=ft_train.RunConfig(name="py", storage_path=sys.argv[1]))
try:
    train(**params)
except PrefectApiUnreachable as e:
    print("train:", e)
try:
    TorchTrainer(params.pop("train_loop"), **params).fit()
except PrefectApiUnreachable as e:
    print("fit:", e)
"""


def test_a_python_call_and_fit_raise_it_from_the_profile(env, dead_api, tmp_path):
    """Set in a Prefect profile, as deployments/README.md has the user do: the fix is to leave the
    profile. A Python call of the flow and `TorchTrainer.fit()` raise it before anything starts;
    and the demo says the same."""
    profile = (
        'active = "ft-train-server"\n\n'
        f'[profiles.ft-train-server]\nPREFECT_API_URL = "{dead_api}"\n'
    )
    os.makedirs(env["PREFECT_HOME"])
    Path(env["PREFECT_HOME"], "profiles.toml").write_text(profile)
    store = str(tmp_path / "runs")
    message = (
        f"the Prefect API at PREFECT_API_URL={dead_api} (set in Prefect profile "
        f"'ft-train-server') cannot be reached ([Errno 111] Connection refused): {FIXES}leave "
        "the profile (prefect profile use ephemeral) to have Prefect start a temporary server"
    )
    done = run(env, tmp_path, "-c", PYTHON_CALLS, store)
    assert (done.returncode, done.stdout) == (0, f"train: {message}\nfit: {message}\n")
    demo = run(env, tmp_path, "-m", "cli", "demo", "--storage-path", store, "--epochs", "1")
    assert (demo.returncode, demo.stdout) == (1, f"error: {message}\n")
    assert not os.path.exists(store)
