"""The `ft-train` command line end to end, as a user runs it: the demo in a child process (Prefect
in ephemeral mode under its own PREFECT_HOME, or the session's Prefect server; a real local Dask
cluster, gloo), against a local path and the loopback S3 endpoint; then `ft-train status`, which
reads storage without Prefect.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli.launch import refused
from deployments import demo
from flows import ephemeral
from ft_train.config import RunConfig, ScalingConfig
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore
from tests.helpers import wait_for

REPO = str(Path(__file__).resolve().parents[1])
TRACEBACK = "Traceback (most recent call last):"
INJECTED = "ft_train.testing.faults.InjectedFault: injected fault on rank 1 at step"


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The child's environment: its own Prefect home (shared by this module's runs, so only the
    first one pays for creating the database), no Prefect API (ephemeral mode) and Prefect's
    other settings at their defaults, no telemetry, and a temporary folder of its own for the
    demo's fault markers."""
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("PREFECT_")]:
        del env[key]
    env["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    return env


def ft_train_cli(env: dict[str, str], cwd, *args: str) -> subprocess.CompletedProcess:
    """`ft-train ARGS` in a child process; stdout and stderr together, as a terminal shows them."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )


def traceback_endings(output: str) -> list[str]:
    """The exception line that ends each traceback in `output`."""
    lines = output.splitlines()
    endings = []
    for i, line in enumerate(lines):
        if line.startswith(TRACEBACK):
            j = i + 1
            while j < len(lines) and lines[j].startswith(" "):
                j += 1
            endings.append(lines[j] if j < len(lines) else "")
    assert output.count("Traceback") == len(endings), output  # none hides mid-line
    return endings


def gone(pid: int) -> bool:
    """Has process `pid` ended? (A zombie has: only its exit status is left to collect.)"""
    import psutil

    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def storage_args(storage) -> list[str]:
    args = ["--storage-path", storage.path]
    for key, value in storage.options.items():
        args += ["--storage-option", f"{key}={value}"]
    return args


def stored_state(storage, name: str):
    return RunStore(Storage(storage.path, storage.options), name).load()


def test_demo_recovers_from_a_crash_then_a_rerun_trains_nothing(
    storage, cli_env, tmp_path, request
):
    """On a local path in Prefect's ephemeral mode, as on a fresh machine; on S3 against a
    running Prefect server (PREFECT_API_URL), as where a team shares one. The rerun runs on the
    server only: what it checks is ft-train's, and in ephemeral mode it would add a temporary
    server's start (about 10 s) to the suite."""
    name = f"cli-demo-{storage.kind}"
    where = storage_args(storage)
    served = storage.kind == "s3"
    if served:
        cli_env = {**cli_env, "PREFECT_API_URL": request.getfixturevalue("prefect_api")}

    first = ft_train_cli(
        cli_env, tmp_path, "demo", "--name", name, *where, "--epochs", "1", "--max-failures", "1"
    )  # fmt: skip
    out = first.stdout
    assert first.returncode == 0, out
    # by default a rank crashes partway: the last one, 2 steps after a checkpoint
    assert "max_failures=1; rank 1 will crash once before step 7" in out, out
    # progress while training, a restart from the checkpoint before the crash
    assert re.search(r"checkpoint checkpoint_000005-a0-\S+ committed at report 5", out), out
    assert re.search(r"2 ranks started from checkpoint checkpoint_000005-a0-", out), out
    # the summary: where the run lives, what it kept, the one failure, a final metric
    assert f"Run '{name}' finished." in out, out
    run_path = re.escape(f"{storage.path}/{name}")
    assert re.search(rf"path +{run_path}\n", out), out
    assert re.search(rf"checkpoints +2 kept, latest {run_path}/checkpoint_000012-a1-", out), out
    failures = re.findall(r"^ +- .*$", out, flags=re.M)
    assert (
        len(failures) == 1 and "exception on rank 1 after report 7: InjectedFault" in failures[0]
    ), out
    assert re.search(r"metrics .*val_accuracy=0\.\d+", out), out
    # what the recovery cost: the reports lost, the time from the last progress to the next
    assert re.search(
        r"recovery +exception on rank 1 after report 7 -> 2 ranks resumed from report 5: "
        r"2 reports lost, \d+\.\d s from the last progress to the first resumed report\n",
        out,
    ), out
    assert re.search(
        r"training cli-demo-\w+ .* 12/12 reports +checkpoint at report 12, 1 failure", out
    )
    # the planned crash is one line at WARNING (its traceback at DEBUG, and in the run state);
    # no traceback at all (Prefect's retry says no more)
    assert re.search(r"\| WARNING \| .* rank 1 raised after report 7: InjectedFault: .* 7\n", out)
    assert traceback_endings(out) == [], out
    assert ("Starting temporary server" in out) is not served, out

    state = stored_state(storage, name)
    assert state.status == "finished"
    assert [f.kind for f in state.failures] == ["exception"]
    assert len(state.attempts) == 2
    # The crash is not part of the run: the demo deployment's parameters are this same run, and
    # a run of them would return it (not be refused a changed train_loop_config)
    assert "faults" not in state.config["train_loop_config"], state.config
    assert not refused(deployment_parameters(storage, name, epochs=1), state)

    if served:
        assert_the_server_has_the_flow_run(name)
        second = ft_train_cli(cli_env, tmp_path, "demo", "--name", name, *where, "--epochs", "1")
        out = second.stdout
        assert second.returncode == 0, out
        assert f"Run '{name}' had already finished: nothing was trained." in out, out
        assert "committed" not in out and "ranks started" not in out, out
        assert "Traceback" not in out, out
        assert re.search(r"metrics .*val_accuracy=0\.\d+", out), out
        assert stored_state(storage, name) == state  # not even re-saved

    shown = ft_train_cli(cli_env, tmp_path, "status", name, *where)
    out = shown.stdout
    assert shown.returncode == 0, out
    assert re.search(r"status +finished", out), out
    assert str(state.latest) in out, out
    assert "exception on rank 1 after report 7: InjectedFault" in out, out
    assert re.search(r"val_accuracy=0\.\d+", out), out

    missing = ft_train_cli(cli_env, tmp_path, "status", "no-such-run", *where)
    assert missing.returncode == 1, missing.stdout
    assert "no run named 'no-such-run'" in missing.stdout
    assert "Traceback" not in missing.stdout


def deployment_parameters(storage, name: str, epochs: int) -> dict:
    """The demo deployment's parameters, as its flow run validates them, with this run's name,
    storage and epochs."""
    run = {**demo.RUN_CONFIG, "name": name, "storage_path": storage.path}
    return {
        **demo.PARAMETERS,
        "train_loop_config": {**demo.TRAIN_LOOP_CONFIG, "epochs": epochs},
        "scaling_config": ScalingConfig.model_validate(demo.SCALING_CONFIG),
        "run_config": RunConfig.model_validate({**run, "storage_options": storage.options}),
    }


def assert_the_server_has_the_flow_run(name: str) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name={"any_": [name]}))
    assert run.state.is_completed()


def test_demo_with_no_faults_trains_cleanly_without_a_traceback(cli_env, tmp_path, prefect_api):
    """`--no-faults`: no crash, no failure, and nothing on the console a user would take for
    one. Against the session's Prefect server (the ephemeral path is the first test's)."""
    store = str(tmp_path / "runs")
    run = ft_train_cli(
        {**cli_env, "PREFECT_API_URL": prefect_api}, tmp_path, "demo", "--name", "cli-clean",
        "--storage-path", store, "--epochs", "1", "--no-faults",
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out
    assert "will crash" not in out and "Run 'cli-clean' finished." in out, out
    assert re.search(r"failures +none\n", out) and "recovery" not in out, out
    assert re.search(r"training cli-clean .* 12/12 reports +checkpoint at report 12 ", out), out
    assert "Traceback" not in out and "ERROR" not in out, out
    state = RunStore(Storage(store), "cli-clean").load()
    assert state.failures == [] and "faults" not in state.config["train_loop_config"]


def test_demo_exits_1_with_the_error_when_the_failure_budget_is_spent(
    cli_env, tmp_path, prefect_api
):
    """Against the session's Prefect server: the ephemeral path is the first test's."""
    store = str(tmp_path / "runs")
    run = ft_train_cli(
        {**cli_env, "PREFECT_API_URL": prefect_api}, tmp_path, "demo", "--name", "cli-spent", "--storage-path", store,
        "--epochs", "1", "--max-failures", "0", "--crash-at-step", "2",
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out
    assert "Run 'cli-spent' failed." in out, out
    assert re.search(r"status +failed", out), out
    assert re.search(r"error: WorkerGroupError: .*max_failures=0", out), out
    # only the rank's traceback; ft-train's and Prefect's internals stay out of the console
    assert traceback_endings(out) == [f"{INJECTED} 2"], out
    assert RunStore(Storage(store), "cli-spent").load().status == "failed"


def test_run_trains_is_killed_and_the_same_command_resumes(cli_env, tmp_path, prefect_api):
    """`ft-train run MODULE:FUNCTION` as a user runs it: SIGKILLed (the CLI process alone, as the
    OOM killer would) after its second checkpoint, then the same command again resumes from it.
    `status --json` and `list --json` then hold the checkpoints, the failure and the final
    metrics. Against the session's Prefect server (the ephemeral path is the demo's)."""
    store = str(tmp_path / "runs")
    # rank 0 holds right after the checkpoint of step 10, once: the kill lands mid-run
    hold = {"rank": 0, "step": 10, "kind": "wait", "marker": str(tmp_path / "hold")}
    command = [
        "run", "ft_train.examples.digits:train_loop", "--name", "cli-run", "--storage-path", store,
        "--workers", "2", "--preload", "sklearn.datasets", "--config", "epochs=2",
        "--config", "checkpoint_every=5", "--config", f"faults={json.dumps([hold])}",
    ]  # fmt: skip
    env = {**cli_env, "PREFECT_API_URL": prefect_api}
    with open(tmp_path / "killed.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "cli", *command],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, for the cleanup below
        )
    try:
        wait_for(lambda: os.path.exists(hold["marker"]), 240, "rank 0 to hold at step 10")
        wait_for(
            lambda: stored_state(Target(store), "cli-run").report_index == 10,
            60,
            "the checkpoint of step 10 to be committed",
        )
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(timeout=60) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):  # its cluster, if it outlived it
            os.killpg(first.pid, signal.SIGKILL)

    again = ft_train_cli(env, tmp_path, *command)
    out = again.stdout
    assert again.returncode == 0, out
    assert "ft-train run: run 'cli-run' exists (running, step 10)" in out, out
    assert re.search(r"2 ranks started from checkpoint checkpoint_000010-a0-", out), out
    assert re.search(r"training cli-run .* 24/24 reports +checkpoint at report 24, 1 failure", out)
    assert "Run 'cli-run' finished." in out, out
    assert re.search(
        r"recovery +driver_crash after report 10 -> 2 ranks resumed from report 10: "
        r"0 reports lost",
        out,
    ), out
    assert "Traceback" not in out, out  # nothing failed in this process

    status = ft_train_cli(env, tmp_path, "status", "cli-run", "--storage-path", store, "--json")
    assert status.returncode == 0, status.stdout
    (listed,) = json.loads(
        ft_train_cli(env, tmp_path, "list", "--storage-path", store, "--json").stdout
    )
    for doc in (json.loads(status.stdout), listed):
        assert doc["name"] == "cli-run" and doc["status"] == "finished", doc
        assert [c["step"] for c in doc["checkpoints"]] == [5, 10, 15, 20, 24], doc
        assert doc["latest_checkpoint"] == doc["checkpoints"][-1]["path"], doc
        assert doc["latest_checkpoint"].startswith(f"{store}/cli-run/checkpoint_000024-a1-"), doc
        assert [(f["kind"], f["step"], f["charged"]) for f in doc["failures"]] == [
            ("driver_crash", 10, False)
        ], doc
        final = doc["final_metrics"]
        assert final["epoch"] == 2 and final["step"] == 24 and final["resumed_from"] == 10, doc
        assert 0 < final["val_accuracy"] <= 1, doc
        assert doc["driver"] is None and doc["driver_runs"] == 2, doc

    # The same name with another config: refused at once, before Prefect starts, with the change
    finished = stored_state(Target(store), "cli-run")
    changed = ft_train_cli(env, tmp_path, *command, "--config", "epochs=3")  # the last one counts
    assert changed.returncode == 1, changed.stdout
    assert "train_loop_config.epochs: 2 -> 3" in changed.stdout, changed.stdout
    assert "--allow-train-loop-change" in changed.stdout, changed.stdout
    assert "flow run" not in changed.stdout and "Traceback" not in changed.stdout, changed.stdout
    assert stored_state(Target(store), "cli-run") == finished


MY_TRAIN = """
import tempfile

import ft_train
from ft_train.testing.faults import maybe_inject


def train_fn(config):
    rank, start = ft_train.get_context().get_world_rank(), 0
    if (ckpt := ft_train.get_checkpoint()) is not None:
        with ckpt.as_directory() as d:
            start = int(open(f"{d}/step").read())
    for step in range(start, config["steps"]):
        maybe_inject(config["faults"], rank, step)
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                open(f"{d}/step", "w").write(str(step + 1))
            ft_train.report({"step": step}, checkpoint=ft_train.Checkpoint.from_directory(d))
"""


def test_run_imports_the_function_from_the_current_directory_in_every_rank(
    cli_env, tmp_path, prefect_api
):
    """`ft-train run my_train:train_fn` beside my_train.py, as `python -m` imports: the driver and
    both ranks find it, and so does the rank that replaces one SIGKILLed at step 3. Run as the
    `ft-train` console script runs (`python -P`: nothing but PYTHONPATH on the import path, and
    PYTHONPATH only the project's). Against the session's Prefect server."""
    (tmp_path / "my_train.py").write_text(MY_TRAIN)
    kill = {"rank": 1, "step": 3, "kind": "kill", "marker": str(tmp_path / "killed")}
    done = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "cli",
            "run",
            "my_train:train_fn",
            "--name",
            "mine",
            "--storage-path",
            str(tmp_path / "runs"),
            "--workers",
            "2",
            "--max-failures",
            "1",
            "--config",
            "steps=6",
            "--config",
            f"faults={json.dumps([kill])}",
        ],  # fmt: skip
        env={**cli_env, "PYTHONPATH": REPO, "PREFECT_API_URL": prefect_api},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    out = done.stdout
    assert done.returncode == 0, out
    assert "Run 'mine' finished." in out, out
    state = stored_state(Target(str(tmp_path / "runs")), "mine")
    assert [(f.kind, f.rank, f.step) for f in state.failures] == [("process_death", 1, 3)], out
    assert state.report_index == 6 and len(state.attempts) == 2, out


class Target:
    """A local storage path, as `stored_state` takes one."""

    def __init__(self, path: str):
        self.path, self.options = path, {}


def test_cli_usage_errors_exit_2_before_anything_starts(cli_env, tmp_path):
    env = {**cli_env, "PYTHONPATH": REPO}
    cases = {
        ("demo", "--no-faults", "--crash-at-step", "3"): "--no-faults trains without a crash",
        ("run", "no_such_module:fn", "--name", "x"): "no_such_module",
        ("run", "tests.loops:report_many", "--name", "x", "--config", "epochs"): "KEY=VALUE",
    }
    for args, words in cases.items():
        proc = ft_train_cli(env, tmp_path, *args, "--storage-path", str(tmp_path / "runs"))
        assert proc.returncode == 2 and words in proc.stdout, (args, proc.stdout)
        assert "Traceback" not in proc.stdout, proc.stdout
    assert not (tmp_path / "runs").exists()
    version = ft_train_cli(env, tmp_path, "--version")
    assert version.returncode == 0 and re.fullmatch(r"ft-train \d+\.\d+\.\d+\n", version.stdout)


def test_the_cli_modules_do_not_import_prefect(cli_env, tmp_path):
    """The command line imports Prefect only when the demo runs: `status` and `list` read
    storage alone, and start as fast."""
    code = "import sys, cli.main; sys.exit('prefect' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=cli_env, cwd=tmp_path).returncode == 0


EPHEMERAL_DRIVER = """
import json, sys
import ft_train
from prefect import flow, get_client
from flows import ephemeral
from flows.train import train

def call(name):
    return train(train_loop="tests.loops:report_many", train_loop_config={"n": 3},
                 scaling_config=ft_train.ScalingConfig(num_workers=1),
                 run_config=ft_train.RunConfig(name=name, storage_path=sys.argv[1])).status

@flow
def parent():
    return ephemeral.start()

out = {"statuses": [call("first"), call("second")]}
server = ephemeral.start()
out["one_server"] = server is ephemeral.start() and server.process is not None
with ephemeral.api(server), get_client(sync_client=True) as client:
    out["flow_runs"] = sorted(r.name for r in client.read_flow_runs())
    out["inside_a_flow"] = parent()  # a flow called from a flow reports to its parent's API
out["server_imported"] = "prefect.server.api.server" in sys.modules
out["pid"] = server.process.pid
out["startup_timeout_s"] = ephemeral.startup_timeout_s()
print(json.dumps(out))
"""


def test_a_python_call_starts_prefects_temporary_server_at_once_and_it_stops_at_exit(
    cli_env, tmp_path
):
    """In ephemeral mode the call starts Prefect's server process as it begins; the calling
    process never imports the server's code (Prefect would, for seconds, before it starts the
    process). Both calls' flow runs are on that one server, which stops when the process exits.
    Prefect's settings at their defaults. (A first start, which creates the database, longer than
    Prefect's 20 s default wait on 2 cores at times, is the module's first test's.)"""
    env = {**cli_env, "PYTHONPATH": REPO}  # the module's Prefect home
    proc = subprocess.run(
        [sys.executable, "-c", EPHEMERAL_DRIVER, str(tmp_path / "runs")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["statuses"] == ["finished", "finished"], out
    assert out["one_server"] and {"first", "second"} <= set(out["flow_runs"]), out
    assert out["inside_a_flow"] is None, out
    assert out["server_imported"] is False, out
    assert out["startup_timeout_s"] == ephemeral.DEFAULT_STARTUP_TIMEOUT_S, out
    assert gone(out["pid"])
    assert proc.stderr.count("Starting temporary server") == 1, proc.stderr
    assert TRACEBACK not in proc.stderr + proc.stdout


def test_a_startup_timeout_the_user_set_is_kept_and_named_when_it_passes(cli_env, tmp_path):
    """PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, where set, bounds the wait for the
    temporary server; when it passes, the call fails with an error that names the setting, and
    the server process is stopped at exit."""
    script = (
        "import sys, ft_train\n"
        "from flows import ephemeral\n"
        "from flows.train import train\n"
        "print('timeout', ephemeral.startup_timeout_s(), flush=True)\n"
        "print('pid', ephemeral.start().process.pid, flush=True)\n"
        "train(train_loop='tests.loops:report_many', train_loop_config={'n': 3},\n"
        "      run_config=ft_train.RunConfig(name='late', storage_path=sys.argv[1]))\n"
    )
    env = {
        **cli_env,
        "PYTHONPATH": REPO,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "runs")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timeout 1.0" in proc.stdout, proc.stdout
    assert traceback_endings(proc.stderr) == [
        "RuntimeError: Prefect's temporary server did not answer within 1s; raise "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or set PREFECT_API_URL to a running server"
    ], proc.stderr[-2000:]
    pid = int(proc.stdout.split("pid ")[1].split()[0])
    assert gone(pid)
    assert not (tmp_path / "runs").exists()  # nothing stored: the run never began


SERVER_START = """
import os, signal, sys
from flows import ephemeral
server = ephemeral.start()
server.wait(ephemeral.startup_timeout_s())
print("healthy", server.port, server.process.pid, flush=True)
if sys.argv[1] == "killed":  # as the OOM killer or `kill -9` ends a driver: no atexit runs
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_temporary_server_stops_when_the_process_that_started_it_is_killed(cli_env, tmp_path):
    """A driver killed outright (SIGKILL, the OOM killer) runs no atexit. Its temporary server
    stops all the same, rather than serving nobody until the machine restarts: the next run of
    the same name, on the same machine, would share the cores with it."""
    import psutil

    env = {**cli_env, "PYTHONPATH": REPO}  # the module's Prefect home: its database exists by now
    proc = subprocess.run(
        [sys.executable, "-c", SERVER_START, "killed"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pid = int(proc.stdout.split()[2])

    try:
        wait_for(
            lambda: gone(pid),
            30,
            "the temporary server to stop after the process that started it was killed",
        )
    except AssertionError:
        psutil.Process(pid).kill()  # leave nothing behind for the next tests
        raise


def test_a_temporary_server_that_cannot_start_fails_the_call_at_once_with_its_own_output(
    cli_env, tmp_path
):
    """A server whose app fails to start (here: a database it cannot open) is not started again
    until the timeout passes: the call fails as soon as it exits, and the user sees its error."""
    env = {
        **cli_env,
        "PYTHONPATH": REPO,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/prefect.db",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SERVER_START, "-"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "unable to open database file" in proc.stderr, proc.stderr[-3000:]  # the server's own
    assert proc.stderr.count("Application startup failed") == 1, proc.stderr  # not started again
    assert proc.stderr.splitlines()[-1] == (
        "RuntimeError: Prefect's temporary server exited with status 3; its output above says why"
    )
