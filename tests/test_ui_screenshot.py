"""A real browser shows the run: `tests/ui_screenshot.py` trains the demo (one failure, one
restart) against `prefect server start`, and headless Chromium renders the flow run's pages;
checked here in the DOM Chromium rendered (the screenshots beside it are for a person to see)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import needs
from tests.ui_screenshot import chromium

SCRIPT = Path(__file__).with_name("ui_screenshot.py")


@pytest.mark.timeout(900)
def test_the_prefect_ui_renders_the_progress_plot_and_failures_of_a_run(tmp_path):
    """Also what a user looks at first: the flow run's Task Runs tab names the restart (the
    retried task run is renamed `train-N (restart 1 from report S)`), and its Artifacts tab,
    one click from the flow run, links straight to the metric plot's page."""
    needs(
        "Chromium, to render the Prefect UI",
        None if chromium() else "no Chromium: apt-get install -y chromium (or set $CHROMIUM)",
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    pages = {stem: Path(f["html"]).read_text() for stem, f in manifest["files"].items()}
    for f in manifest["files"].values():
        png = Path(f["png"]).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, f["png"]

    assert 'data-testid="image-data:image/svg+xml;base64,' in pages["plot"], "the plot is drawn"
    assert 'data-testid="table-display"' in pages["failures"]
    assert "max_failures=2: 1 used, 1 left" in pages["failures"]
    assert "Progress: 100%" in pages["progress"]
    for kind in ("progress", "metrics", "metrics-plot", "failures", "restarts"):
        assert f"-{kind}</" in pages["flow-run-artifacts"], f"the flow run lists its {kind}"
    plot_page = f"/artifacts/artifact/{manifest['ids']['metrics-plot']}"
    assert plot_page in pages["flow-run-artifacts"], "the plot is one click from the Artifacts tab"
    assert "(restart 1 from report" in pages["flow-run-task-runs"], "the restart is named"
