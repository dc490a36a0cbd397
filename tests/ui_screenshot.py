"""Screenshots of what Prefect's UI shows of an ft-train run, taken by a real browser.

    python tests/ui_screenshot.py OUT_DIR

Starts `prefect server start` on loopback (a fresh PREFECT_HOME), trains the demo against it
(2 epochs, 2 ranks, rank 1 raises at step 13: one failure and a restart), then has headless
Chromium (Debian's `chromium`; another with $CHROMIUM) load the flow run's page, its Task Runs and
Artifacts tabs and the plot's and failures table's own pages in the default (v2) UI. Writes OUT_DIR/*.png,
each page's DOM as rendered (OUT_DIR/*.html) and OUT_DIR/manifest.json (the ids and files).
`tests/test_ui_screenshot.py` runs it and checks the rendered pages.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "ui-demo"
PAGES = {  # file stem: (path under the UI, window height)
    "flow-run": ("/v2/runs/flow-run/{flow_run}", 1000),
    "flow-run-task-runs": ("/v2/runs/flow-run/{flow_run}?tab=TaskRuns", 1000),
    "flow-run-artifacts": ("/v2/runs/flow-run/{flow_run}?tab=Artifacts", 1400),
    "plot": ("/v2/artifacts/artifact/{metrics-plot}", 900),
    "failures": ("/v2/artifacts/artifact/{failures}", 800),
    "progress": ("/v2/artifacts/artifact/{progress}", 600),
}


def chromium() -> str | None:
    found = os.environ.get("CHROMIUM") or shutil.which("chromium")
    return found or shutil.which("chromium-browser")


def main(out: Path) -> dict:
    browser = chromium()
    if browser is None:
        raise SystemExit("no Chromium: apt-get install -y chromium (or set $CHROMIUM)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as home:
        server, port, env = _start_server(home, out)
        try:
            demo = [sys.executable, __file__, "--demo", str(Path(home) / "runs")]
            subprocess.run(demo, env=env, check=True, cwd=ROOT, timeout=600)
            ids = _ids(env)
            files = {}
            for stem, (path, height) in PAGES.items():
                url = f"http://127.0.0.1:{port}" + path.format(**ids)
                files[stem] = _shoot(browser, url, out / stem, height)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    manifest = {"ids": ids, "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def demo(storage: str) -> None:
    """The demo run, against the server in PREFECT_API_URL."""
    sys.path.insert(0, str(ROOT))
    import ft_train
    from deployments import demo as params
    from flows.train import train

    fault = {"rank": 1, "step": 13, "kind": "raise", "marker": f"{storage}/fault-1-13"}
    os.makedirs(storage, exist_ok=True)
    train(
        train_loop=params.TRAIN_LOOP,
        train_loop_config={**params.TRAIN_LOOP_CONFIG, "epochs": 2, "faults": [fault]},
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=NAME,
            storage_path=storage,
            failure_config=ft_train.FailureConfig(max_failures=2),
        ),
        cluster=ft_train.ClusterConfig(**params.CLUSTER),
    )


def _ids(env: dict) -> dict[str, str]:
    """The flow run's id, and its artifacts' by kind (`tasks/live.py`, `tasks/publish.py`)."""
    os.environ.update(env)  # this process is the script's own: Prefect reads them at import
    sys.path.insert(0, str(ROOT))
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from tasks.keys import artifact_key

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[NAME]))
        )
        (run,) = runs
        found = {a.key: str(a.id) for a in client.read_artifacts() if a.flow_run_id == run.id}
    kinds = ("progress", "metrics", "metrics-plot", "failures", "checkpoints", "summary")
    return {"flow_run": str(run.id), **{k: found[artifact_key(NAME, k)] for k in kinds}}


def _shoot(browser: str, url: str, stem: Path, height: int) -> dict[str, str]:
    """A screenshot of `url` and its DOM once the page's scripts had 20 s of (virtual) time."""
    flags = [
        browser,
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size=1400,{height}",
        "--virtual-time-budget=20000",
    ]
    png, html = stem.with_suffix(".png"), stem.with_suffix(".html")
    subprocess.run(
        [*flags, f"--screenshot={png}", url], check=True, timeout=180, capture_output=True
    )
    dom = subprocess.run([*flags, "--dump-dom", url], timeout=180, capture_output=True, text=True)
    html.write_text(dom.stdout)
    return {"url": url, "png": str(png), "html": str(html)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortLost(RuntimeError):
    """The server did not get its port: another process (a Dask comm of a test beside this one)
    bound it between `_free_port()` and the server's own bind."""


def _start_server(home: str, out: Path) -> tuple[subprocess.Popen, int, dict]:
    """`prefect server start` on a free port, answering; a new port when another process took
    the one picked (three tries)."""
    for _ in range(3):
        port = _free_port()
        env = {
            **os.environ,
            "PREFECT_HOME": home,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
            "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
            "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
            + ["--port", str(port)],
            env=env,
            stdout=(out / "server.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_healthy(port, server, out / "server.log")
            return server, port, env
        except _PortLost:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    raise RuntimeError(f"prefect server start lost its port three times: {out / 'server.log'}")


def _wait_healthy(port: int, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            if "address already in use" in log.read_text(errors="replace").lower():
                raise _PortLost(port)
            raise RuntimeError(f"prefect server start exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2):
                return
        except http.client.HTTPException as e:  # not HTTP: another process has the port
            raise _PortLost(port) from e
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the Prefect server did not answer in {timeout_s:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--demo"]:
        demo(sys.argv[2])
    else:
        print(json.dumps(main(Path(sys.argv[1])), indent=1))
