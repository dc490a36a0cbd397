"""`ft-train list` and `ft-train status`: what they read from storage, on a local path and on S3,
with no Prefect."""

import contextlib
import io
import json
import os
import re

import ft_train
from cli import main as cli
from ft_train.driver.prepare import RunPlan, prepare_run
from ft_train.storage.run_state import STATE_FILE
from tests.conftest import on_storage
from tests.helpers import fresh


def noop_train_loop(config):
    """An importable train_loop for `prepare_run`; never called."""


def prepare(target, name: str, config=None) -> RunPlan:
    return prepare_run(
        f"{__name__}:noop_train_loop",
        config or {},
        ft_train.ScalingConfig(),
        ft_train.RunConfig(name=name, storage_path=target.path, storage_options=target.options),
        log=lambda msg: None,
    )


def cli_out(target, *args: str) -> tuple[int, str]:
    options = [f"--storage-option={k}={v}" for k, v in target.options.items()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([*args, "--storage-path", target.path, *options])
    return code, out.getvalue()


def table(text: str) -> dict[str, dict[str, str]]:
    """`ft-train list`'s lines, by run name and column."""
    header, *rows = (line.rstrip() for line in text.splitlines())
    columns = re.split(r"  +", header)
    return {cells[0]: dict(zip(columns, cells)) for cells in (re.split(r"  +", r) for r in rows)}


def test_list_shows_each_run_with_its_progress_and_the_driver_training_it(storage):
    done = prepare(storage, "alpha")
    done.state.status, done.state.report_index = "finished", 12
    done.store.save(done.state)
    done.release()
    held = prepare(storage, "beta")  # a driver (this process) trains it now
    fresh(storage).write_atomic("stray/notes.txt", b"not a run")
    fresh(storage).write_atomic(f"broken/{STATE_FILE}", b"{not json")
    newer = done.state.model_copy(update={"name": "newer", "schema_version": 99})
    fresh(storage).write_atomic(f"newer/{STATE_FILE}", newer.model_dump_json().encode())
    try:
        code, out = cli_out(storage, "list")
        json_code, json_out = cli_out(storage, "list", "--json")
    finally:
        held.release()
    assert code == 0, out
    runs = table(out)
    assert sorted(runs) == ["alpha", "beta", "broken", "newer"], out  # "stray" is no run
    assert runs["alpha"]["STATUS"] == "finished" and runs["alpha"]["REPORTS"] == "12", out
    assert "DRIVER" not in runs["alpha"], out  # released: no driver
    assert runs["beta"]["STATUS"] == "running", out
    assert runs["beta"]["DRIVER"].startswith(f"pid {os.getpid()} on "), out
    assert runs["beta"]["DRIVER"].endswith("training it now"), out
    assert runs["broken"]["STATUS"] == "unreadable", out
    assert runs["newer"]["STATUS"] == "unreadable", out  # a newer ft-train's: read as a rerun would

    assert json_code == 0, json_out
    docs = {d["name"]: d for d in json.loads(json_out)}  # the same runs, for scripts
    assert sorted(docs) == ["alpha", "beta", "broken", "newer"], json_out
    assert docs["alpha"]["status"] == "finished" and docs["alpha"]["reports"] == 12
    assert docs["alpha"]["driver"] is None and docs["alpha"]["failures"] == []
    assert docs["beta"]["driver"]["pid"] == os.getpid(), json_out
    assert docs["beta"]["driver"]["state"] == "training it now", json_out
    assert docs["broken"]["status"] == "unreadable" and "run_state.json" in docs["broken"]["error"]


@on_storage("local")
def test_list_of_a_path_without_runs_says_so(storage):
    code, out = cli_out(storage, "list")
    assert (code, out) == (0, f"no runs under {storage.path}\n")
    assert cli_out(storage, "list", "--json") == (0, "[]\n")


@on_storage("s3")
def test_status_shows_the_config_the_run_last_trained_with(storage):
    prepare(storage, "run", {"lr": 0.1, "epochs": 3}).release()
    code, out = cli_out(storage, "status", "run")
    assert code == 0, out
    assert re.search(r"train_loop +tests.test_cli_runs:noop_train_loop\n", out), out
    assert re.search(r'config +\{"epochs": 3, "lr": 0.1\}\n', out), out
    code, out = cli_out(storage, "status", "run", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["config"]["train_loop_config"] == {"epochs": 3, "lr": 0.1}, out
    assert doc["status"] == "running" and doc["checkpoints"] == [] and doc["failures"] == []
    assert doc["path"] == f"{storage.path}/run" and doc["driver"] is None, out


@on_storage("local")
def test_output_cut_short_by_its_reader_ends_without_a_traceback(storage, tmp_path):
    """`ft-train status run | head -1`: the reader closes the pipe before the command is done."""
    import subprocess
    import sys

    prepare(storage, "run").release()
    reader, writer = os.pipe()
    os.close(reader)  # gone before the command writes a line
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "status", "run", "--storage-path", storage.path],
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=repo),
    )
    os.close(writer)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
