"""The test suite's own rules: the quick lane's guard (`tests/unit/conftest.py`) is in force, the
lane neither sleeps nor reads the wall clock, and no test module imports another (what they share
lives in `tests/helpers.py` and the other non-test modules under `tests/`)."""

import ast
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import NotInTheQuickLane

TESTS = Path(__file__).resolve().parents[1]


def test_a_subprocess_or_a_socket_fails_a_quick_test():
    with pytest.raises(NotInTheQuickLane, match="move it to tests/"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(NotInTheQuickLane, match="socket"):
        socket.create_connection(("127.0.0.1", 9))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def all_test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_no_test_module_imports_or_names_another():
    """An import of a test module runs its module-level code and ties two files' tests together;
    a `"tests.test_<name>:fn"` train_loop string does the same from a worker. Either is a helper that
    belongs in a non-test module."""
    found = []
    for path in all_test_modules():
        own = module_name(path)
        source = path.read_text()
        names: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        names.update(re.findall(r"\btests(?:\.unit)?\.test_\w+", source))
        for name in names:
            parts = name.split(".")
            target = ".".join(parts[: 3 if parts[1:2] == ["unit"] else 2])
            if target.split(".")[-1].startswith("test_") and target != own:
                found.append(f"{path.relative_to(TESTS.parent)} uses {target}")
    assert not found, "\n".join(sorted(set(found)))


def test_the_quick_lane_neither_sleeps_nor_reads_the_wall_clock():
    """A quick test that sleeps is slow, and one that asserts on elapsed time fails on a loaded
    machine: waits go through events, and time through a clock the test controls."""
    forbidden = re.compile(r"\btime\.(sleep|time|monotonic|perf_counter)\b|\bsleep\(")
    found = [
        f"{path.relative_to(TESTS.parent)}:{n}: {line.strip()}"
        for path in sorted((TESTS / "unit").rglob("*.py"))
        if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert not found, "\n".join(found)
