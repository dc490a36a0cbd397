"""A rank's journal: what it has reported, kept outside its process.

`report()` hands its messages to the driver in batches (`rank.DaskSender`), so a rank that dies
loses what is still queued. The guarantee the journal keeps: once `report()` has returned on
every rank for round k, round k's checkpoint is committed even if a rank dies the next instant
(SIGKILL, `os._exit`, an OOM kill). Before `report()` returns, the rank writes to files in its
node's shared memory (tmpfs), which outlive its process:

- `rank-{r}.index`: the highest report index that returned, 8 bytes rewritten in place by one
  `pwrite` (a process killed next cannot tear it). The file exists once the rank has joined its
  process group;
- `rank-{r}.first`: when the rank first returned from report() in this attempt (8 bytes,
  epoch seconds, written once): where a restart's wait ended, should the driver have received
  none of the attempt's reports (it counts what a recovery cost: `reached`);
- `rank-{r}.jsonl`: every checkpoint message, one line each, as sent to the driver. An
  asynchronous upload writes an intent line (`"upload": "pending"`) before `report()` returns
  and the full message once its files are stored: a round with an intent and no message is
  incomplete.

After a group has stopped, the driver reads the journals of its attempt through each node's
nanny, which outlives its worker (`collect`, which then removes them), and commits the newest
round that every rank reached (`controller.rounds.ReportRounds.recover`); after a clean finish
it only removes them. A lost node takes its journals with it: then
only what reached the driver counts.

Bounded: once an agreement tells a rank that every rank has reached report L, it drops the lines
before the newest one at or below L (no round before that can be the newest complete one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..protocol import Report, UploadIntent
from . import scratch

_INDEX = struct.Struct("<q")
_TIME = struct.Struct("<d")


def journal_root() -> str:
    """Shared memory where the node has it (a write costs a microsecond, no disk), else the
    temporary directory (`scratch`). The same on a worker and on its nanny (they share the
    environment)."""
    return scratch.folder("ft-train-journal", memory=True)


def run_key(run_uri: str) -> str:
    """The run's journal directory name: a run's attempts sit side by side under it."""
    return hashlib.sha1(run_uri.encode()).hexdigest()[:16]


class Journal:
    """The rank's side. Thread-safe: the upload thread journals completed uploads."""

    def __init__(self, run: str, attempt_id: str, rank: int, root: str | None = None):
        self.rank = rank
        run_dir = os.path.join(root or journal_root(), run)
        self.dir = os.path.join(run_dir, attempt_id)
        os.makedirs(self.dir, exist_ok=True)
        _sweep(run_dir, keep=attempt_id)
        self._lines_path = os.path.join(self.dir, f"rank-{rank}.jsonl")
        self._lock = threading.Lock()
        self._lines: list[tuple[int, bytes]] = []  # (report index, line), as in the file
        self._lines_fd = os.open(self._lines_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._index_fd: int | None = None
        self._start: int | None = None  # the start report index, until the first report

    def joined(self, index: int) -> None:
        """The rank joined its process group; `index` is its start report index."""
        path = os.path.join(self.dir, f"rank-{self.rank}.index")
        self._index_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        self.reached(index)
        self._start = index

    def reached(self, index: int) -> None:
        """report() `index` is returning."""
        if self._index_fd is not None:
            os.pwrite(self._index_fd, _INDEX.pack(index), 0)
        if self._start is not None and index > self._start:  # the attempt's first report
            self._start = None
            first = os.path.join(self.dir, f"rank-{self.rank}.first")
            fd = os.open(first, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.pwrite(fd, _TIME.pack(time.time()), 0)
            finally:
                os.close(fd)

    def append(self, msg: Report | UploadIntent) -> None:
        """A checkpoint message (or an upload's intent); one write, so whole or absent."""
        line = json.dumps(msg.wire(), separators=(",", ":")).encode() + b"\n"
        with self._lock:
            os.write(self._lines_fd, line)
            self._lines.append((msg.index, line))

    def all_reached(self, index: int) -> None:
        """Every rank has reached report `index`: drop the lines before the newest one at or
        below it (written to a new file, then renamed over the old one: never torn)."""
        with self._lock:
            below = [i for i, _ in self._lines if i <= index]
            if not below or min(i for i, _ in self._lines) == max(below):
                return
            keep = [(i, line) for i, line in self._lines if i >= max(below)]
            tmp = self._lines_path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(b"".join(line for _, line in keep))
            os.replace(tmp, self._lines_path)
            os.close(self._lines_fd)
            self._lines_fd = os.open(self._lines_path, os.O_WRONLY | os.O_APPEND)
            self._lines = keep

    def close(self) -> None:
        """The rank's process stays (the files stay too, for the driver to read)."""
        for fd in (self._lines_fd, self._index_fd):
            if fd is not None:
                os.close(fd)
        self._index_fd = None


def _sweep(run_dir: str, keep: str) -> None:
    """Remove the journals of the run's earlier attempts: the driver read them before it
    started this one, or died (and a new driver starts from committed checkpoints only)."""
    for name in os.listdir(run_dir):
        if name != keep:
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def collect(run: str, attempt_id: str, root: str | None = None) -> dict[int, dict[str, Any]]:
    """Run on a node (by its nanny): the journals of an attempt's ranks on this node, then
    removed. rank -> {"index": the highest report that returned, "at": when it returned (epoch
    seconds: the index file's time), "first_at": when its first report of the attempt returned,
    "messages": [...]}; a rank that never joined its group has no "index", one that never
    reported no "first_at"."""
    path = os.path.join(root or journal_root(), run, attempt_id)
    found: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return found
    for name in names:
        stem, _, ext = name.partition(".")
        if not stem.startswith("rank-") or ext not in ("index", "jsonl", "first"):
            continue
        entry = found.setdefault(int(stem[5:]), {"messages": []})
        with open(os.path.join(path, name), "rb") as f:
            data, at = f.read(), os.fstat(f.fileno()).st_mtime
        if ext == "index" and len(data) == _INDEX.size:
            entry["index"], entry["at"] = _INDEX.unpack(data)[0], at
        elif ext == "first" and len(data) == _TIME.size:
            entry["first_at"] = _TIME.unpack(data)[0]
        elif ext == "jsonl":
            entry["messages"] = _parse(data)
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # the run's directory, once it holds no attempt
        os.rmdir(os.path.dirname(path))
    return found


@dataclass(frozen=True)
class Reached:
    """How far every rank of an attempt got, from their journals (times in epoch seconds)."""

    index: int  # the newest report every rank returned from
    at: float  # when the last of them returned from it
    first_at: float | None  # when every rank had returned from its first report; None: not all


def progress(run: str, attempt_id: str, ranks: int, root: str | None = None) -> Reached | None:
    """What an attempt's ranks on this node had reached, read from their index files (left in
    place), or None unless every one of its `ranks` ranks' file is here (`reached`). A new
    driver asks it of the attempt its crashed predecessor was running: the ranks' progress past
    the run state's last save, which died with that driver."""
    path = os.path.join(root or journal_root(), run, attempt_id)
    found: dict[int, dict[str, Any]] = {}
    for rank in range(ranks):
        try:
            with open(os.path.join(path, f"rank-{rank}.index"), "rb") as f:
                data, at = f.read(), os.fstat(f.fileno()).st_mtime
        except OSError:
            return None
        if len(data) == _INDEX.size:
            found[rank] = {"index": _INDEX.unpack(data)[0], "at": at}
    return reached(found, ranks)


def reached(journals: dict[int, dict[str, Any]], ranks: int) -> Reached | None:
    """From `ranks` ranks' journals (as `collect` reads them): how far every one of them got;
    None unless every rank's index is there (a lost node's ranks: what they reached is
    unknown)."""
    got = [j for r, j in journals.items() if r < ranks and "index" in j]
    if len(got) < ranks or not got:
        return None
    index = min(j["index"] for j in got)
    # A rank further on reached `index` before its file's time: the newest that stopped there.
    at = max(j["at"] for j in got if j["index"] == index)
    firsts = [j.get("first_at") for j in got]
    first_at = None if None in firsts else max(f for f in firsts if f is not None)
    return Reached(index, at, first_at)


def _parse(data: bytes) -> list[dict[str, Any]]:
    # Each line was one write(), so whole; what follows the last newline is never a line.
    return [json.loads(line) for line in data.split(b"\n")[:-1]]
