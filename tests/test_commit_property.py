"""A property-based proof of the commit protocol (DESIGN.md, "Storage layout and commit protocol").

Hypothesis draws a run: a `CheckpointConfig` (num_to_keep, a score attribute and order) and a
sequence of operations, each a checkpoint save (one or more ranks, a few files of random sizes,
a random score; the ranks' file names distinct or shared, uploaded from rank 0 up or from the
highest rank down) or a driver restart (the driver ends cleanly or is killed). The sequence runs
through the real code: `prepare.prepare_run` (lease, run state, orphan sweep), ranks' `Session.
report` (uploads), `ReportRounds` and `CheckpointManager.commit` (manifest, run state, sealing,
retention). If it makes W storage writes, it runs W more times on fresh storage, stopping dead
after write 1, 2, ..., W (`CrashingStorage` raises `Crash`, a BaseException no library code may
swallow, and refuses every write after it). Each time a new driver then starts on what reached
storage, and the test asserts:

- the run state parses (the new driver starts at all);
- its latest checkpoint is the last one committed, or the one whose commit the crash cut short;
- that checkpoint and every other one the state references (sealed index included) is
  restorable: its manifest is there and every file in it verifies, with the bytes saved (of a
  name that several ranks saved, the lowest rank's), and no side path (`.ft-dup`) is left in it;
- no checkpoint directory is left unreferenced after the new driver's start (its orphan sweep),
  except one older than the head that only the sealed index can tell from a sealed one.

Runs on a local directory and on fsspec's `memory://`.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft_train.config import CheckpointConfig, RunConfig, ScalingConfig
from ft_train.driver import prepare
from ft_train.storage.checkpoint import Checkpoint
from ft_train.storage.checkpoint_manager import (
    CHECKPOINT_DIR,
    CheckpointManager,
    checkpoint_dir_name,
)
from ft_train.storage.fs import DUPLICATES, Storage, local_files
from ft_train.storage.run_state import RunStore
from ft_train.worker.session import Session
from tests.write_path import NOOP, commit_round, rank_spec, write_tree

INDEX_CHUNK = 2  # so that runs with num_to_keep=None seal index chunks within a few saves

# -- crash injection --------------------------------------------------------------------------------

# Every method of Storage, by whether it changes what is stored. A method added to Storage fails
# `test_every_storage_method_is_classified` until it is put in one of these; a mutating one must
# also be counted by CrashingStorage.
MUTATING = {
    "write_atomic",
    "write_if",
    "upload_dir",
    "_create_file",
    "_put_file",
    "move_file",
    "delete_dir",
}
READ_ONLY = {
    "__init__",
    "__getstate__",
    "__setstate__",
    "__repr__",
    "fs",
    "is_local",
    "_is_s3",
    "full",
    "uri",
    "read_bytes",
    "read_many",
    "_cat",
    "read_versioned",
    "list_dir",
    "download_files",  # writes local files only
    "unusable",  # looks at the root, writes nothing
}


class Crash(BaseException):
    """The process stops here. A BaseException: library code that catches Exception lets it by,
    as it would let a SIGKILL."""


class Budget:
    """The storage writes of one run, counted across every driver and rank of it: the
    `crash_after`-th write is the last one; the process is dead from then on."""

    def __init__(self, crash_after: int | None):
        self.crash_after, self.writes, self.crashed = crash_after, 0, False
        self._lock = threading.Lock()  # the lease's renewal thread writes too

    def before(self) -> None:
        if self.crashed:
            raise Crash("a write after the crash")

    def after(self, what: str) -> None:
        with self._lock:
            self.writes += 1
            if self.writes == self.crash_after:
                self.crashed = True
        if self.crashed:
            raise Crash(f"after write {self.writes}: {what}")


class CrashingStorage(Storage):
    """A real Storage that counts every mutating call on its `Budget` and dies after its last
    write. `upload_dir` counts each file (`_put_file`) and then itself, so a crash can tear an
    upload between two files. `killed` stops only this driver's writes (a killed driver)."""

    def __init__(self, url, options, budget: Budget):
        super().__init__(url, options)
        self.budget, self.killed = budget, False

    def _do(self, what: str, call, *args, **kwargs):
        if self.killed:
            raise Crash("a write by a killed driver")
        self.budget.before()
        result = call(*args, **kwargs)
        self.budget.after(what)
        return result

    def write_atomic(self, path, data):
        return self._do(f"write {path}", super().write_atomic, path, data)

    def write_if(self, path, data, tag):
        return self._do(f"write_if {path}", super().write_if, path, data, tag)

    def upload_dir(self, local_dir, path, should_stop=None, rank=0):
        return self._do(f"upload {path}", super().upload_dir, local_dir, path, should_stop, rank)

    def _create_file(self, src, base, rel, side, should_stop):
        return self._do(f"create {rel}", super()._create_file, src, base, rel, side, should_stop)

    def _put_file(self, src, dst, should_stop, exclusive=False):
        return self._do(f"put {dst}", super()._put_file, src, dst, should_stop, exclusive)

    def move_file(self, src, dst):
        return self._do(f"move {src}", super().move_file, src, dst)

    def delete_dir(self, path):
        return self._do(f"delete {path}", super().delete_dir, path)


def test_every_storage_method_is_classified():
    """The crash proof holds only if the proxy sees every write: a new Storage method must be
    classified here, and a mutating one counted by CrashingStorage."""
    methods = {n for n, v in vars(Storage).items() if callable(v) or isinstance(v, property)}
    unknown = methods - MUTATING - READ_ONLY
    assert not unknown, (
        f"Storage has new methods {sorted(unknown)}: add each to MUTATING (and override it in "
        "CrashingStorage) if it changes what is stored, else to READ_ONLY"
    )
    assert MUTATING <= methods and READ_ONLY <= methods
    assert MUTATING <= set(vars(CrashingStorage)), "CrashingStorage must count every write"


# -- the operations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Save:
    ranks: tuple[tuple[tuple[str, int, int], ...] | None, ...]  # per rank: (name, size, seed)
    score: int | float | None
    shared: bool = False  # the ranks' files share names (the lowest rank's is kept)
    reverse: bool = False  # the ranks upload from the highest down (rank 0's file comes last)


@dataclass(frozen=True)
class Restart:
    killed: bool  # else the driver ended and released its lease (it failed, or was stopped)


rank_files = st.lists(
    st.tuples(
        st.sampled_from(["model.pt", "optim.pt", "data.pt"]),
        st.integers(0, 3000),
        st.integers(0, 2**16),
    ),
    min_size=1,
    max_size=2,
    unique_by=lambda f: f[0],
).map(tuple)
saves = st.builds(
    Save,
    ranks=st.lists(st.one_of(st.none(), rank_files), min_size=1, max_size=3)
    .filter(lambda ranks: any(r is not None for r in ranks))
    .map(tuple),
    score=st.one_of(st.integers(-3, 3), st.none(), st.just(float("nan"))),
    shared=st.booleans(),
    reverse=st.booleans(),
)
# Saves, each maybe followed by a restart (so that most examples save more than once).
operations = st.lists(
    st.tuples(saves, st.one_of(st.none(), st.builds(Restart, st.booleans()))),
    min_size=1,
    max_size=4,
).map(lambda steps: [op for step in steps for op in step if op is not None])
configs = st.builds(
    CheckpointConfig,
    num_to_keep=st.sampled_from([None, 1, 2, 3]),
    checkpoint_score_attribute=st.sampled_from([None, "score"]),
    checkpoint_score_order=st.sampled_from(["max", "min"]),
)


def content(rank: int, spec: tuple[str, int, int], shared: bool) -> tuple[str, bytes]:
    name, size, seed = spec
    data = random.Random(seed * 8 + rank).randbytes(size)  # each rank's bytes its own
    return (name if shared else f"r{rank}-{name}"), data


@dataclass
class World:
    """What the test knows the run did: the bytes of each checkpoint it saved, and the commits."""

    url: str
    name: str
    cfg: CheckpointConfig
    budget: Budget
    saved: dict[str, dict[str, bytes]] = field(default_factory=dict)
    committed: str | None = None  # the last checkpoint whose commit() returned
    in_flight: str | None = None  # the checkpoint being saved when the crash came
    drivers: int = 0

    def run_config(self) -> RunConfig:
        return RunConfig(name=self.name, storage_path=self.url, checkpoint_config=self.cfg)


class Driver:
    """One driver process: its lease and run state from `prepare_run`, its commits as the
    controller makes them (`make_controller`'s CheckpointManager), its ranks as `Session`s."""

    def __init__(self, world: World, work: str):
        self.world, self.work = world, work
        self.storage = CrashingStorage(world.url, {}, world.budget)
        self.attempt = world.drivers
        self.attempt_id = f"{self.attempt:08x}" * 4  # a new one per driver, as uuid4 would be
        world.drivers += 1
        self.plan = prepare.prepare_run(
            NOOP,
            {},
            ScalingConfig(),
            world.run_config(),
            log=lambda msg: None,
            storage=self.storage,
        )
        self.manager = CheckpointManager(self.storage, self.plan.store, world.cfg, INDEX_CHUNK)

    def save(self, op: Save) -> None:
        w, state = self.world, self.plan.state
        index = state.report_index + 1
        dir_name = checkpoint_dir_name(index, self.attempt, self.attempt_id)
        w.saved[dir_name] = {}
        w.in_flight = dir_name
        metrics = {"step": index} if op.score is None else {"step": index, "score": op.score}
        msgs: list[dict] = []
        for rank, specs in enumerate(op.ranks):  # the lowest rank's file of each name is kept
            for rel, data in (content(rank, s, op.shared) for s in specs or ()):
                w.saved[dir_name].setdefault(rel, data)
        order = list(enumerate(op.ranks))
        for rank, specs in reversed(order) if op.reverse else order:
            spec = rank_spec(
                self.storage, w.name, rank, len(op.ranks), self.attempt, self.attempt_id, index - 1
            )
            session = Session(spec, send=msgs.append)
            if specs is None:  # this rank attaches no checkpoint to the round
                session.report(metrics)
                continue
            files = dict(content(rank, s, op.shared) for s in specs)
            local = write_tree(f"{self.work}/r{rank}-{uuid.uuid4().hex[:6]}", files)
            session.report(metrics, checkpoint=Checkpoint.from_directory(local))
            shutil.rmtree(local)
        commit_round(self.manager, state, msgs, index, self.attempt)
        w.committed, w.in_flight = dir_name, None

    def end(self, killed: bool) -> None:
        """Release the lease, or (killed) write nothing more: the lease stays held by a dead
        process, as after a SIGKILL."""
        self.storage.killed = self.storage.killed or killed
        try:
            self.plan.release()
        except Crash:
            pass  # the dead driver's release never reaches storage


def play(world: World, ops: list, work: str) -> None:
    """Run `ops` until the end or the crash. A crash inside `prepare_run` leaves no driver."""
    current: Driver | None = None
    try:
        current = Driver(world, work)
        for op in ops:
            if isinstance(op, Save):
                current.save(op)
            else:
                current.end(op.killed)
                current = None
                current = Driver(world, work)
    except Crash:
        pass
    finally:
        if current is not None:
            current.end(killed=True)


# -- what the next driver finds ---------------------------------------------------------------------


def check_next_driver(world: World, work: str) -> None:
    """Start a driver on plain storage, as a rerun after the crash, and check what it finds."""
    storage = Storage(world.url)
    plan = prepare.prepare_run(
        NOOP, {}, ScalingConfig(), world.run_config(), log=lambda msg: None
    )  # raises if the run state does not parse
    try:
        state = plan.state
        where = f"writes={world.budget.writes} crash_after={world.budget.crash_after}"
        assert state.latest in {world.committed, world.in_flight}, where
        if state.latest is None:
            assert world.committed is None, f"committed {world.committed} lost ({where})"
        entries = RunStore(storage, world.name).all_checkpoints(state)
        referenced = {e.dir_name for e in entries}
        assert state.latest is None or state.latest in {e.dir_name for e in state.checkpoints}
        for dir_name in referenced:  # the latest among them
            restored = tempfile.mkdtemp(dir=work, prefix="restore-")
            Checkpoint(storage.uri(f"{world.name}/{dir_name}")).download_verified(restored)
            got = {}
            for rel in local_files(restored):
                with open(f"{restored}/{rel}", "rb") as f:
                    got[rel] = f.read()
            got.pop(".ft_manifest.json")
            assert got == world.saved[dir_name], f"{dir_name} ({where})"
            assert DUPLICATES not in storage.list_dir(f"{world.name}/{dir_name}"), where
        oldest = min((e.report_index for e in state.checkpoints), default=0)
        for n in storage.list_dir(world.name):  # what the start's orphan sweep left
            if (m := CHECKPOINT_DIR.match(n)) and n not in referenced:
                assert state.sealed_chunks and int(m.group(1)) < oldest, f"orphan {n} ({where})"
    finally:
        plan.release()


def prove(url: str, cfg: CheckpointConfig, ops: list, work: str) -> int:
    """Run `ops` once to count its writes, then once per crash point; return the runs made."""
    crash_after, runs = 1, 0
    while True:
        name = f"run-{crash_after}"
        world = World(url, name, cfg, Budget(crash_after))
        play(world, ops, work)
        check_next_driver(world, work)
        runs += 1
        if not world.budget.crashed:  # the whole sequence ran: every write has been a crash point
            return runs
        crash_after += 1


PROOF = settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_crash_after_any_write_leaves_the_run_restorable(where):
    @PROOF
    @given(cfg=configs, ops=operations)
    def proof(cfg, ops):
        work = tempfile.mkdtemp(prefix="ft-proof-")
        root = f"memory://ft-proof-{uuid.uuid4().hex[:8]}" if where == "memory" else f"{work}/runs"
        try:
            assert prove(root, cfg, ops, work) >= 2  # a driver's start alone writes twice
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if where == "memory":
                fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)

    proof()
