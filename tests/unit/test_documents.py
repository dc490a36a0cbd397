"""The documents a user reads first stay short and their links lead somewhere: the README at most
250 lines, and every relative link in it, in deployments/README.md, bench/README.md and docs/
names a file of this repository (docs/ as a site is also built --strict: tests/test_docs.py)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "deployments" / "README.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of the markdown links in `text` that are paths, not URLs or anchors; code
    blocks and spans are left out (a `[x](y)` in code is not a link)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def test_the_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the details into docs/"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file(document):
    broken = [
        target
        for target in relative_links(document.read_text())
        if not (document.parent / target.split("#")[0]).exists()
    ]
    assert not broken, f"{document.relative_to(ROOT)} links to what does not exist: {broken}"


def test_a_broken_link_is_found():
    assert relative_links("see [the page](docs/nope.md) and [site](https://x.org) `[a](b)`") == [
        "docs/nope.md"
    ]
