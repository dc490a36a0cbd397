"""A rank's report path standing alone, for the report-path tests: a rank's spec on a storage,
a checkpoint directory written from bytes, a `Storage` whose uploads wait on a gate, the staging
directories a session leaves, and a storage fault in a checkpoint's path."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

from ft_train.protocol import RankSpec
from ft_train.storage.checkpoint_manager import checkpoint_dir_name
from ft_train.storage.fs import Storage
from tests.rank_specs import rank_spec

ATTEMPT_ID = "c0ffee" + "0" * 26


def spec(storage: Storage, rank: int = 0, world: int = 1, name: str = "run") -> RankSpec:
    return rank_spec(
        storage, rank, world, name=name, attempt_id=ATTEMPT_ID, collective_timeout_s=1800.0
    )


def write_checkpoint(root, files: dict[str, bytes]) -> str:
    d = tempfile.mkdtemp(dir=root)
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)
    return d


def digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class GatedStorage(Storage):
    """A real Storage whose uploads wait for `gate` (so a test can hold one in flight) and are
    counted as they start."""

    def __init__(self, url, options=None):
        super().__init__(url, options)
        self.gate, self.started = threading.Event(), []

    def upload_dir(self, local_dir, path, should_stop=None, rank=0):
        self.started.append(path)
        assert self.gate.wait(60), "the test never opened the gate"
        return super().upload_dir(local_dir, path, should_stop, rank)


def staged_dirs(root: str) -> list[str]:
    """Snapshot directories under a staging root (each session's directory holds its own)."""
    if not os.path.isdir(root):
        return []
    return [
        os.path.join(own, s)
        for own in Path(root).iterdir()
        if own.is_dir()
        for s in os.listdir(own)
    ]


def block_checkpoint_path(storage_root: str, name: str, index: int) -> None:
    """A real storage fault: a file where the checkpoint's directory must be created."""
    path = os.path.join(storage_root, name, checkpoint_dir_name(index, 0, ATTEMPT_ID))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Path(path).write_bytes(b"in the way")
