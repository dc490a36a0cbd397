"""The documentation builds: `mkdocs build --strict` over docs/ fails on a broken link, a missing
page or a page left out of the navigation (mkdocs.yml), and this test fails with it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "concepts" / "index.html").exists()
