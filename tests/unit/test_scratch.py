"""The node's scratch space has one owner (`ft_train.worker.scratch`): every user finds shared
memory, and its per-process directories, through it."""

from __future__ import annotations

import ast
import fcntl
import os
import pathlib
import tempfile

import pytest

import ft_train
from ft_train.snapshots import piece_files
from ft_train.snapshots.format import pack
from ft_train.worker import journal, scratch

REPO = pathlib.Path(__file__).resolve().parents[2]
OWNER = REPO / "ft_train" / "worker" / "scratch.py"


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (prose may name /dev/shm)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_only_the_scratch_module_names_shared_memory_in_code():
    named = []
    for root in ("ft_train", "flows", "tasks", "cli", "bench"):
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text()
            if path == OWNER or "/dev/shm" not in text:
                continue
            tree = ast.parse(text)
            prose = docstrings(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and "/dev/shm" in node.value
                    and id(node) not in prose
                ):
                    named.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not named, f"/dev/shm named outside ft_train/worker/scratch.py: {named}"


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node whose shared memory and temporary directory are the test's own."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    monkeypatch.setattr(scratch, "SHARED_MEMORY", str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return shm, tmp


def scratch_users() -> dict[str, str]:
    """Where each user of the scratch space writes, as it finds it."""
    with ft_train.staging_dir(0) as staged:  # an empty checkpoint fits any memory
        pass
    pack(lambda d: None)  # a snapshot=save piece, written in a packing directory first
    return {
        "journal": journal.journal_root(),
        "pieces": str(piece_files.directory()),
        "staging": staged,
        "packing": scratch.process_dir(scratch.folder("ft-train-packing", memory=True)),
    }


def test_every_user_finds_shared_memory_through_the_owner_and_tmp_without_it(node, monkeypatch):
    shm, tmp = node
    assert all(pathlib.Path(p).is_relative_to(shm) for p in scratch_users().values())

    monkeypatch.setattr(scratch, "SHARED_MEMORY", str(shm / "none"))  # a host without one
    where = scratch_users()
    assert where.pop("pieces") == "None"  # no piece files: the bytes go over Dask's comms
    assert all(pathlib.Path(p).is_relative_to(tmp) for p in where.values()), where
    assert scratch.memory_free() == 0


def test_a_dead_owners_directory_is_swept_and_a_live_ones_kept(tmp_path):
    root = str(tmp_path / "folder")
    live, live_fd = scratch.claim_dir(root)
    dead = os.path.join(root, "dead")  # what a killed process leaves: its lock, free now
    os.makedirs(dead)
    open(dead + ".lock", "w").close()
    stray = os.path.join(root, "stray")  # a directory whose owner died before its lock
    os.makedirs(stray)

    mine, fd = scratch.claim_dir(root)  # sweeps first
    assert os.path.isdir(live) and os.path.isdir(mine)
    assert not os.path.exists(dead) and not os.path.exists(dead + ".lock")
    assert not os.path.exists(stray)
    with open(live + ".lock") as f, pytest.raises(BlockingIOError):  # still its owner's
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)

    scratch.release(live, live_fd)
    assert not os.path.exists(live) and not os.path.exists(live + ".lock")
    assert scratch.process_dir(root) == scratch.process_dir(root)  # one for the process
    scratch.release(mine, fd)
