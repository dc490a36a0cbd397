"""The control plane at 8, 128 and 1 024 ranks: `python -m bench.scale` (bench/README.md).

Simulated ranks (`bench/scale_sim.py`: threads, no torch, no Dask cluster) drive the real
controller, worker-group event handling, `Session.report()`, journals, storage, run state and
checkpoint manager. Per rank count it measures:

- commit: from the round's reports reaching the driver (every rank's file uploaded, the
  reports handed over at once) to the run state referencing the checkpoint
  (`Callback.on_checkpoint_committed`), one file per rank; the best of `--commits` rounds
  (what is above it is this machine's load, chiefly the two fsyncs).
  "round" is from the round's start (its step done) to the same point: the ranks' uploads, all
  on this machine's 2 cores, included;
- teardown: from the scheduler's `remove-worker` event for one rank (the others waiting for it
  in their step) to `run_segment` raising (group stopped, journals read, failure recorded);
- driver CPU: CPU time of the driver's threads (the controller's, and the Dask client's that
  unpacks the events), per round, metrics-only and with a checkpoint: read at the end of each
  round, once the driver has handled it; the median over the rounds;
- the run state after `--checkpoints` commits (`num_to_keep=None`: all kept, the worst case),
  made as a run makes them (`CheckpointManager.commit`, a manifest of one file per rank): the
  head's size and the sealed index's, and the time to load each. Written to /dev/shm (fsync
  there is free: the figure is the state, not this disk).

Costs grow no faster than linearly: each figure's growth ratios 128/8 and 1024/128 are taken per
rank ((cost(b)/b) / (cost(a)/a)); a ratio above `LINEAR_SLACK` fails. A 1 024-rank commit on local
storage must take under 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ft_train
from ft_train.controller import Callback, Controller, GroupPlan
from ft_train.errors import AttemptFailed
from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore
from ft_train.worker import scratch

from .scale_sim import Script, SimCluster, SimGroup, Timings

RANKS = (8, 128, 1024)
LINEAR_SLACK = 1.5  # a per-rank growth ratio above this is worse than linear (noise allowed)
COMMIT_TARGET_S = 1.0  # a 1 024-rank commit on local storage


@dataclass
class Figures:
    ranks: int
    commit_s: float = 0.0
    round_s: float = 0.0
    teardown_s: float = 0.0
    teardown_stop_s: float = 0.0  # of which the ranks ending (threads here, processes in a run)
    teardown_journals_s: float = 0.0  # and the journals read (by each node's nanny in a run)
    cpu_metrics_s: float = 0.0
    cpu_checkpoint_s: float = 0.0
    head_bytes: int = 0
    index_bytes: int = 0
    load_head_s: float = 0.0
    load_index_s: float = 0.0
    commit_first_s: float = 0.0  # the state's figure: mean commit of the first and last 100
    commit_last_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class _Stamps(Callback):
    """When each round's checkpoint was committed; lets the ranks go on (`Timings.commit_of`)."""

    def __init__(self, timings: Timings) -> None:
        self.committed: dict[int, float] = {}
        self.timings = timings

    def on_checkpoint_committed(self, entry, state) -> None:  # type: ignore[no-untyped-def]
        self.committed[state.report_index] = time.monotonic()
        self.timings.commit_of(state.report_index).set()


def _controller(ranks: int, storage: Storage, cluster: SimCluster, stamps: _Stamps) -> Controller:
    name = f"scale-{ranks}"
    store = RunStore(storage, name)
    plan = GroupPlan(
        train_loop="bench.scale_sim:simulated",  # never imported: the ranks are threads
        config={},
        name=name,
        storage=storage,
        min_workers=ranks,
        max_workers=ranks,
        use_gpu=False,
        start_timeout_s=60.0,
        collective_timeout_s=1800.0,
        agreement_interval_s=0.25,
        elastic_wait_s=0.0,
    )
    manager = CheckpointManager(storage, store, ft_train.CheckpointConfig())
    return Controller(
        cluster,
        plan,
        RunState(name=name),
        store,
        manager,
        ft_train.FailureConfig(max_failures=1),  # else the defaults: the hang watchdog on (1 800 s)
        callbacks=[stamps],
    )


def run_group(ranks: int, storage: Storage, metrics_rounds: int, commits: int) -> Figures:
    """One group of `ranks`: a first checkpoint (the warm-up), `metrics_rounds` metrics-only
    rounds and a checkpoint, `commits` checkpoint rounds, then one rank dies."""
    rounds = "c" + "m" * metrics_rounds + "c" + "c" * commits + "m"
    script = Script(rounds, die=(ranks - 1, len(rounds) - 1))
    local = tempfile.mkdtemp(prefix="ft-scale-ranks-")
    cluster = SimCluster(ranks, script, local)
    stamps = _Stamps(cluster.timings)
    ctl = _controller(ranks, storage, cluster, stamps)
    figures = Figures(ranks)
    try:
        for _ in range(2 + commits):  # the group's start and a commit, the metrics rounds and
            ctl.run_segment()  # a commit, then the timed commits
        t = cluster.timings
        last = metrics_rounds + 2 + commits
        while last not in t.driver_cpu:  # its round's end, once run_segment has returned
            time.sleep(0.001)

        def cpu(i: int) -> float:  # the driver's, for round i (from the end of round i - 1)
            return t.driver_cpu[i] - t.driver_cpu[i - 1]

        figures.cpu_metrics_s = statistics.median(cpu(i) for i in range(2, metrics_rounds + 2))
        timed = range(metrics_rounds + 3, metrics_rounds + 3 + commits)
        figures.cpu_checkpoint_s = statistics.median(cpu(i) for i in timed)
        figures.commit_s = min(stamps.committed[i] - t.sent[i] for i in timed)
        figures.round_s = statistics.median(stamps.committed[i] - t.started[i] for i in timed)
        figures.teardown_s = _teardown(ctl, cluster, ranks)
        group = cluster.groups[-1]
        figures.teardown_stop_s, figures.teardown_journals_s = group.stop_s, group.journals_s
    finally:
        cluster.close()
        shutil.rmtree(local, ignore_errors=True)
    return figures


def _teardown(ctl: Controller, cluster: SimCluster, ranks: int) -> float:
    """Lose the last rank once it has died and every other rank waits for it; the time until
    the controller has stopped the group and recorded the failure."""
    group: SimGroup = cluster.groups[-1]
    lost_at: list[float] = []

    def scheduler() -> None:
        cluster.timings.died.wait()
        while group.step.n_waiting < ranks - 1:
            time.sleep(0.001)
        lost_at.append(time.monotonic())
        group.lose(ranks - 1)

    thread = threading.Thread(target=scheduler, name="sim-scheduler", daemon=True)
    thread.start()
    try:
        ctl.run_segment()
    except AttemptFailed:
        pass
    else:
        raise RuntimeError("the lost rank did not fail the group")
    done = time.monotonic()
    thread.join()
    failure = ctl.state.failures[-1]
    assert failure.kind == "process_death" and failure.rank == ranks - 1, failure
    return done - lost_at[0]


def run_state_growth(ranks: int, checkpoints: int, figures: Figures) -> None:
    """`checkpoints` commits, as a run makes them; the state's size and load times."""
    base = scratch.shared_memory()
    root = tempfile.mkdtemp(prefix="ft-scale-state-", dir=base)
    try:
        storage = Storage(root)
        store = RunStore(storage, "run")
        manager = CheckpointManager(storage, store, ft_train.CheckpointConfig(num_to_keep=None))
        state = RunState(name="run")
        files = {f"rank{r}.pt": {"size": 1024, "sha256": "0" * 64} for r in range(ranks)}
        times = []
        for k in range(1, checkpoints + 1):
            dir_name = checkpoint_dir_name(k, 0, "0" * 32)
            began = time.perf_counter()
            manager.commit(state, dir_name, k, {"loss": 1.0 / k, "step": k}, files, 0)
            times.append(time.perf_counter() - began)
            storage.delete_dir(f"run/{dir_name}")  # the files are not the state: room only
        n = min(100, len(times))
        figures.commit_first_s = statistics.mean(times[:n])
        figures.commit_last_s = statistics.mean(times[-n:])
        figures.head_bytes = os.path.getsize(storage.full(store.path))
        figures.index_bytes = sum(
            os.path.getsize(storage.full(store.chunk_path(i))) for i in range(state.sealed_chunks)
        )
        figures.load_head_s = _best(lambda: store.load())
        loaded = store.load()
        assert loaded is not None and loaded.latest == state.latest
        figures.load_index_s = _best(lambda: store.all_checkpoints(loaded))
        assert len(store.all_checkpoints(loaded)) == checkpoints
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _best(fn: Any, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


@contextlib.contextmanager
def s3_storage() -> Iterator[Storage]:
    """A bucket on moto's S3 server on loopback, in its own process (not the driver's)."""
    import socket

    import s3fs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "moto_server"),
            "-H",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        for _ in range(100):
            try:
                fs.mkdir("ft-scale")
                break
            except Exception:
                time.sleep(0.1)
        yield Storage("s3://ft-scale/runs", options)
    finally:
        server.terminate()
        server.wait(10)


# -- the table ------------------------------------------------------------------------------

# (label, attribute, unit scale, unit): each a cost that must grow no faster than the ranks
ROWS = (
    ("commit, local (s)", "commit_s", 1.0, "s"),
    ("teardown after a lost rank (s)", "teardown_s", 1.0, "s"),
    ("driver CPU / metrics round (ms)", "cpu_metrics_s", 1e3, "ms"),
    ("driver CPU / checkpoint round (ms)", "cpu_checkpoint_s", 1e3, "ms"),
    ("run state head (KB)", "head_bytes", 1e-3, "KB"),
    ("sealed index (KB)", "index_bytes", 1e-3, "KB"),
    ("load head (ms)", "load_head_s", 1e3, "ms"),
    ("load head + index (ms)", "load_index_s", 1e3, "ms"),
    ("state commit, first 100 (ms)", "commit_first_s", 1e3, "ms"),
    ("state commit, last 100 (ms)", "commit_last_s", 1e3, "ms"),
)


# not judged: what the simulation does on this machine's 2 cores that a run does in parallel
INFO_ROWS = (
    ("(info) round, local (s): with the ranks' uploads", "round_s", 1.0, "s"),
    ("(info) teardown: the ranks ending (s)", "teardown_stop_s", 1.0, "s"),
    ("(info) teardown: the journals read (s)", "teardown_journals_s", 1.0, "s"),
)


def per_rank_ratio(a: Figures, b: Figures, attr: str) -> float | None:
    """(cost(b) / ranks(b)) / (cost(a) / ranks(a)): above 1, worse than linear."""
    ca, cb = getattr(a, attr), getattr(b, attr)
    if not ca or not cb:
        return None
    return (cb / b.ranks) / (ca / a.ranks)


def verdicts(
    results: list[Figures], rows: tuple[tuple[str, str, float, str], ...] = ROWS
) -> list[tuple[str, bool, str]]:
    """(target, met, why), one per row measured and one for the 1 024-rank commit."""
    out = []
    for label, attr, _, _ in rows:
        if not any(getattr(f, attr) for f in results):
            continue  # not measured (--checkpoints 0)
        ratios = [per_rank_ratio(a, b, attr) for a, b in zip(results, results[1:])]
        worst = max((r for r in ratios if r is not None), default=None)
        met = worst is None or worst <= LINEAR_SLACK
        out.append((f"{label}: no faster than linear", met, f"worst per-rank ratio {_fmt(worst)}"))
    big = [f for f in results if f.ranks == 1024 and not f.extra.get("s3")]
    if big:
        met = big[0].commit_s < COMMIT_TARGET_S
        out.append(("1 024-rank commit, local, < 1 s", met, f"{big[0].commit_s:.3f} s"))
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: list[Figures], s3: list[Figures] = ()) -> str:  # type: ignore[assignment]
    heads = [f"{f.ranks} ranks" for f in results]
    pairs = [f"{b.ranks}/{a.ranks} per rank" for a, b in zip(results, results[1:])]
    lines = [
        "| figure | " + " | ".join(heads + pairs) + " |",
        "|---" * (1 + len(heads + pairs)) + "|",
    ]
    rows = [*ROWS, *INFO_ROWS]
    for label, attr, scale, _ in rows:
        values = [f"{getattr(f, attr) * scale:.3g}" for f in results]
        ratios = [_fmt(per_rank_ratio(a, b, attr)) for a, b in zip(results, results[1:])]
        lines.append(f"| {label} | " + " | ".join(values + ratios) + " |")
    for attr, label in (("commit_s", "commit, S3 (s)"), ("round_s", "round, S3 (s)")):
        if s3:
            values = [f"{getattr(f, attr):.3g}" for f in s3]
            ratios = [_fmt(per_rank_ratio(a, b, attr)) for a, b in zip(s3, s3[1:])]
            lines.append(f"| {label} | " + " | ".join(values + ratios) + " |")
    lines.append("")
    s3_verdicts = verdicts(s3, (("commit, S3 (s)", "commit_s", 1.0, "s"),)) if s3 else []
    for target, met, why in verdicts(results) + s3_verdicts:
        lines.append(f"- {'MET' if met else 'MISSED'}: {target} ({why})")
    return "\n".join(lines)


def measure(ranks: int, args: argparse.Namespace, storage: Storage | None = None) -> Figures:
    own = storage is None
    root = tempfile.mkdtemp(prefix="ft-scale-run-") if own else ""
    try:
        rounds = args.metrics_rounds or max(40, 8192 // ranks)
        figures = run_group(ranks, storage or Storage(root), rounds, args.commits)
        if own and args.checkpoints:
            run_state_growth(ranks, args.checkpoints, figures)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)), help="rank counts")
    parser.add_argument("--commits", type=int, default=7, help="checkpoint rounds timed")
    parser.add_argument("--metrics-rounds", type=int, default=0, help="0: max(40, 8192/ranks)")
    parser.add_argument("--checkpoints", type=int, default=10_000, help="for the run state")
    parser.add_argument("--s3", action="store_true", help="also commit to S3 (moto on loopback)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    counts = [int(r) for r in args.ranks.split(",")]
    results = []
    for ranks in counts:
        began = time.monotonic()
        results.append(measure(ranks, args))
        print(f"{ranks} ranks measured in {time.monotonic() - began:.0f} s", file=sys.stderr)
    s3_results: list[Figures] = []
    if args.s3:
        with s3_storage() as storage:
            for ranks in counts:
                figures = measure(
                    ranks, argparse.Namespace(**{**vars(args), "commits": 2}), storage
                )
                figures.extra["s3"] = True
                s3_results.append(figures)
    print(table(results, s3_results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([vars(r) for r in results + s3_results], f, indent=1)
    return 0 if all(met for _, met, _ in verdicts(results)) else 1


if __name__ == "__main__":
    sys.exit(main())
