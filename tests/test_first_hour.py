"""A newcomer's first hour, from the documents themselves: the commands of the fenced ```bash
blocks of README.md and deployments/README.md, parsed from the markdown (not a copy), run in
order as a user types them, with an empty HOME (so an empty Prefect home, ~/.prefect, and empty
~/ft_train_results), from the repository root; once the README first, then the guide, and once
the other way round. A command fails the test when it exits non-zero or prints a traceback; so
do the guide's background processes (the worker) and the stored runs, checked at the end.

How the documents mark a block (an HTML comment on the line before it, which a reader of the
rendered page does not see):
- `<!-- first-hour: skip (why) -->`: not run (the whole suite, a module or a database of your own).
- `<!-- first-hour: server ... -->`: `prefect server start`. The test starts it itself, with
  `--host 127.0.0.1 --port <free> --no-ui` added (other tests may hold port 4200; the UI's build
  is not what this tests), waits until it answers, and puts its port in place of
  `127.0.0.1:4200` in the document's later commands.
- `<!-- first-hour: background ... -->`: a long-running command (the worker) that the guide runs in
  a terminal of its own: started beside the commands that follow, stopped after the document.

What the test leaves out of a command: the `python3 -m venv` and `pip install` parts of a line
(`a && b && c`: what follows them still runs) are skipped, since the project is installed
already, with its test extra, in the environment that runs the tests; `.venv/bin/X` runs that
environment's X, and so do bare `prefect` and `ft-train` (its bin directory comes first on
PATH). PYTHONPATH names this checkout, so the commands import its code (an environment shared by
several checkouts has one of them installed). Telemetry is off (DO_NOT_TRACK,
PREFECT_SERVER_ANALYTICS_ENABLED): the test machine may be offline.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ft_train.result import TrainResult
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunStore
from ft_train.worker.rank import free_port
from tests.helpers import wait_for
from tests.prefect_e2e import start, stop, tail

REPO = Path(__file__).resolve().parents[1]
README, GUIDE = "README.md", "deployments/README.md"
DEFAULT_API = "127.0.0.1:4200"
MARK = re.compile(r"^\s*<!--\s*first-hour:\s*(\w+)")
FENCE = re.compile(r"^(\s*)```bash\s*$")


@dataclasses.dataclass
class Block:
    doc: str
    line: int  # where the fence opens, 1-based
    mark: str | None  # "skip", "server", "background" or None
    commands: list[str]


def blocks(doc: str) -> list[Block]:
    """The ```bash blocks of `doc`, each with its mark (the comment on the line before) and its
    commands: backslash-continued lines joined, comments and blank lines left out."""
    lines = (REPO / doc).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(opening.group(1))
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        mark = MARK.match(before)
        body, start = [], i + 1
        i = start
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:])
            i += 1
        found.append(Block(doc, start, mark.group(1) if mark else None, commands(body)))
        i += 1
    return found


def commands(body: list[str]) -> list[str]:
    out, pending = [], ""
    for line in body:
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        if text and not text.startswith("#"):
            out.append(text)
    assert not pending, f"a command ends with a backslash: {pending}"
    return out


def test_the_documents_mark_what_the_test_cannot_run():
    """The parse itself: every block of each document is found, with its mark. A new block that
    must not run (or that starts a server) fails here until it is marked."""
    readme, guide = blocks(README), blocks(GUIDE)
    assert [b.mark for b in readme] == [None, "skip", "skip"], readme
    assert readme[0].commands == [
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/ft-train demo"
    ]
    assert without_install(readme[0].commands[0]) == ".venv/bin/ft-train demo"
    assert [b.mark for b in guide] == [
        "server", None, None, "background", None, None, "skip"
    ], guide  # fmt: skip
    assert guide[0].commands == ["prefect server start"]
    assert guide[3].commands == ["prefect worker start --pool ft-train-process"]
    runnable = [c for b in guide if b.mark is None for c in b.commands]
    assert any(c.startswith("prefect deployment run 'ft-train/demo' --param") for c in runnable)


def without_install(command: str) -> str:
    """`command` without its `python3 -m venv` and `pip install` parts (joined by `&&`)."""
    parts = [p.strip() for p in command.split("&&")]
    return " && ".join(
        p for p in parts if not p.startswith("python3 -m venv") and "pip install" not in p
    )


class FirstHour:
    """One user's machine: an empty home, the commands' environment, what runs in the background."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.home = tmp_path, tmp_path / "home"
        self.home.mkdir()
        bin_dir = str(Path(sys.executable).parent)
        self.bin = bin_dir
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
        self.env = {
            **keep,
            "HOME": str(self.home),
            "PATH": os.pathsep.join([bin_dir, keep.get("PATH", "")]),
            "PYTHONPATH": str(REPO),
            "TMPDIR": str(tmp_path),
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        self.log: list[str] = []

    def run(self, command: str, where: str) -> None:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=900,
        )
        self.log.append(f"$ {command}  ({where})\n{done.stdout}")
        assert done.returncode == 0, (
            f"`{command}` ({where}) exited {done.returncode}:\n{done.stdout}"
        )
        assert "Traceback" not in done.stdout, f"`{command}` ({where}) printed:\n{done.stdout}"

    def follow(self, doc: str) -> None:
        """Every runnable command of `doc`, in order; its server and background processes."""
        port, server, background = free_port(), None, []
        api = f"127.0.0.1:{port}"
        try:
            for block in blocks(doc):
                where = f"{doc}:{block.line}"
                if block.mark == "skip":
                    continue
                for command in block.commands:
                    command = without_install(command)  # installed already (the docstring)
                    if not command:
                        continue
                    command = command.replace(".venv/bin/", f"{self.bin}/")
                    command = command.replace(DEFAULT_API, api)
                    if block.mark == "server":
                        server = self.serve(command, port)
                    elif block.mark == "background":
                        log = self.tmp / f"background-{len(background)}.log"
                        background.append(
                            (start(["bash", "-c", command], self.env, REPO, log), log)
                        )
                    else:
                        self.run(command, where)
        finally:
            for proc, log in background:
                stop(proc)
                self.log.append(f"--- {log.name}\n{tail(log)}")
            if server is not None:
                stop(server)
        for _, log in background:
            text = log.read_text(errors="replace")
            assert "Traceback" not in text, f"{log} has a traceback:\n{text[-6000:]}"

    def serve(self, command: str, port: int) -> subprocess.Popen:
        log = self.tmp / "server.log"
        args = f"{command} --host 127.0.0.1 --port {port} --no-ui"
        server = start(["bash", "-c", args], self.env, REPO, log)

        def answers() -> bool:
            if server.poll() is not None:
                return True
            try:
                return httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).is_success
            except httpx.HTTPError:
                return False

        wait_for(answers, 300, f"`{args}` to answer")
        assert server.poll() is None, f"`{args}` exited {server.returncode}:\n{tail(log)}"
        return server

    def stored(self, name: str):
        storage = Storage(str(self.home / "ft_train_results"))
        return RunStore(storage, name).load()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("order", [(README, GUIDE), (GUIDE, README)], ids=["readme", "guide"])
def test_the_readme_and_the_deployments_guide_in_either_order(tmp_path, order):
    """Either order: the runs are the same run (`ft-train demo` and the `demo` deployment's
    defaults), so the second document's finds the first's finished and trains nothing; the
    guide leaves the default profile active, so the Quick start keeps its temporary server."""
    user = FirstHour(tmp_path)
    try:
        for doc in order:
            user.follow(doc)
    except AssertionError as e:
        raise AssertionError(f"{e}\n\n=== everything run ===\n" + "\n".join(user.log)) from None
    demo, mine = user.stored("demo"), user.stored("demo-1")
    assert demo.status == "finished" and demo.driver_runs == 1, demo  # only the first trained
    crashes = [f.kind for f in demo.failures]
    assert crashes == (["exception"] if order[0] == README else []), demo.failures
    assert mine.status == "finished", mine  # the run given a name alone
    # ... keeps the deployment's other run-config settings: num_to_keep=2 of steps 5, 10, 12
    kept = TrainResult.from_path(str(user.home / "ft_train_results"), "demo-1").best_checkpoints
    assert sorted(m["step"] for _, m in kept) == [10, 12], kept
