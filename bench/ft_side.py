"""ft-train's side of the benchmark: the training function, and one measurement per call.

Run by `bench.run` in a fresh process per measurement:
    python -m bench.ft_side FIGURE PARAMS_JSON OUT_JSON
The flow is called as a user calls it (`flows.train.train`), with the same workload as Ray's side
(`bench.workload.run_loop`). PREFECT_HOME / PREFECT_API_URL come from the environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import ft_train
from bench.workload import Api, read_events, run_loop

TRAIN_LOOP = "bench.ft_side:train_loop"


class FtApi(Api):
    system = "ft-train"
    async_owns_dir = False  # report() snapshots the directory; the loop deletes it
    snapshot = None  # files() -> {file: state} for report(snapshot=...), set by use_snapshots()

    def __init__(self, staging: bool = True):
        self.staging = staging  # False: save into a plain temporary directory, as Ray's side does

    def rank(self) -> int:
        return ft_train.get_context().get_world_rank()

    def prepare_model(self, model):
        return ft_train.torch.prepare_model(model)

    @contextlib.contextmanager
    def checkpoint_dir(self) -> Iterator[str | None]:
        ckpt = ft_train.get_checkpoint()
        if ckpt is None:
            yield None
        else:
            with ckpt.as_directory() as d:
                yield d

    def report(self, metrics: dict, checkpoint_dir: str | None, mode: str) -> None:
        ckpt = ft_train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ft_train.report(
            metrics,
            checkpoint=ckpt,
            checkpoint_upload_mode=mode,
            snapshot=self.snapshot() if self.snapshot else None,
        )

    def preemption_info(self):
        return ft_train.get_preemption_info()

    def use_snapshots(self, files, jit) -> None:
        self.snapshot = files
        ft_train.enable_jit_checkpoint(files=jit)

    @contextlib.contextmanager
    def save_dir(self, nbytes: int, taken_over: bool) -> Iterator[str]:
        """ft_train.staging_dir: in memory where the checkpoint fits there, else on disk."""
        if not self.staging:
            with super().save_dir(nbytes, taken_over) as d:
                yield d
            return
        with ft_train.staging_dir(nbytes) as d:
            yield d

    def wait_committed(self, config: dict, step: int) -> None:
        """ft-train has no worker-side call for it: poll the stored run state (bounded)."""
        run = config["run"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(ft_train.StorageError):
                r = ft_train.TrainResult.from_path(run["path"], run["name"], run["options"])
                if r.metrics and r.metrics.get("step", 0) >= step:
                    return
            time.sleep(0.02)  # polling a condition on storage, bounded by the deadline
        raise TimeoutError(f"checkpoint of step {step} not committed within 60 s")


def train_loop(config: dict) -> None:
    run_loop(config, FtApi(staging=config.get("staging", True)))


# -- helpers ---------------------------------------------------------------------------------


def storage_target(p: dict) -> tuple[str, dict]:
    """(storage_path, storage_options): a local directory, or a fresh bucket on the loopback S3."""
    if p.get("storage", "local") == "local":
        return os.path.join(p["workdir"], "storage"), {}
    import s3fs

    bucket = f"ft-{uuid.uuid4().hex[:10]}"
    opts = {"endpoint_url": p["s3_endpoint"], "key": "testing", "secret": "testing"}
    s3fs.S3FileSystem(skip_instance_cache=True, **opts).mkdir(bucket)
    return f"s3://{bucket}/runs", opts


def call_flow(
    name: str,
    config: dict,
    p: dict,
    cluster=None,
    max_failures: int = 1,
    snapshot_every: int | None = None,
) -> dict:
    from flows.train import train

    path, opts = storage_target(p)
    config = {**config, "run": {"path": path, "options": opts, "name": name}}
    t_call = time.time()
    result = train(
        train_loop=p.get("train_loop", TRAIN_LOOP),  # another loop only for what-if experiments
        train_loop_config=config,
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(
            name=name,
            storage_path=path,
            storage_options=opts,
            failure_config=ft_train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ft_train.CheckpointConfig(
                num_to_keep=1, snapshot_every=snapshot_every
            ),
        ),
        cluster=cluster or ft_train.ClusterConfig(),
    )
    t_return = time.time()
    return {
        "t_call": t_call,
        "t_return": t_return,
        "status": result.status,
        # with the time the driver recorded each failure: how long detection took
        "failures": [(f.kind, f.rank, f.step, f.time.timestamp()) for f in result.failures],
    }


def fault(p: dict, kind: str, rank: int = 1, step: int = 7) -> dict:
    return {
        "rank": rank,
        "step": step,
        "kind": kind,
        "marker": os.path.join(p["workdir"], f"fault-{uuid.uuid4().hex[:6]}"),
    }


# -- figures ---------------------------------------------------------------------------------


def recovery(p: dict) -> dict:
    """A rank SIGKILLs its own process at step 7 (checkpoint at step 5); `p["workload"]`:
    the MLP, or the transformer (`bench.goodput --state-check`)."""
    events = os.path.join(p["workdir"], "events.jsonl")
    cfg = {
        "steps": 10,
        "events": events,
        "checkpoint_every": 5,
        "report_every": 0,
        "faults": [fault(p, "kill")],
        "workload": p.get("workload", "mlp"),
    }
    run = call_flow("recovery", cfg, p)
    return {"run": run, "events": read_events(events)}


class DaskCluster:
    """A Dask cluster of separate processes, as deployed: a scheduler and `dask worker`s, each a
    nanny process with one single-threaded worker process under it, all reading ft-train's
    settings from the file `ft-train dask-config` prints (docs/clusters.md)."""

    def __init__(self, workdir: str):
        import yaml

        from ft_train.driver.dask_settings import dask_config

        config = os.path.join(workdir, "dask-config.yaml")  # `ft-train dask-config`, as documented
        with open(config, "w") as f:
            yaml.safe_dump(dask_config(), f)
        self.env = dict(os.environ, DASK_CONFIG=config)
        self.dask = os.path.join(os.path.dirname(sys.executable), "dask")
        self.log = open(os.path.join(workdir, "dask.log"), "ab")
        self.procs: list[subprocess.Popen] = []
        self.address = ""

    def _start(self, args: list[str], new_node: bool = False) -> dict | None:
        """Start `dask *args`; `new_node`: as `bench.goodput.start_node` starts a node in place
        of a lost one, and what it says of it."""
        from bench.goodput import start_node

        cmd = [self.dask, *args]
        kw = dict(env=self.env, stdout=self.log, stderr=self.log, start_new_session=True)
        proc, record = start_node(cmd, **kw) if new_node else (subprocess.Popen(cmd, **kw), None)
        self.procs.append(proc)
        return record

    def add_worker(self, new_node: bool = False) -> dict | None:
        """Start one more worker (a node joining, `new_node`: in place of a lost one); it joins
        in the background."""
        return self._start(
            [
                "worker",
                self.address,
                "--nthreads",
                "1",
                "--memory-limit",
                "0",
                "--no-dashboard",
                "--host",
                "127.0.0.1",
                "--preload-nanny",  # as docs/clusters.md starts a worker
                "ft_train.worker.forkserver",
                "--preload",
                "ft_train.driver.cluster",
            ],
            new_node,
        )

    def close(self) -> None:
        for pr in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pr.pid, 9)  # our own process groups (start_new_session)
            pr.wait()
        self.log.close()


@contextlib.contextmanager
def dask_cluster(workdir: str, n: int) -> Iterator[DaskCluster]:
    """A scheduler and `n` workers (`DaskCluster`), once all have joined."""
    from distributed import Client

    cluster = DaskCluster(workdir)
    addr_file = os.path.join(workdir, "scheduler.json")
    try:
        cluster._start(
            [
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--dashboard-address",
                "127.0.0.1:0",
                "--scheduler-file",
                addr_file,
            ]
        )
        with Client(scheduler_file=addr_file, timeout="60s") as c:  # waits for the file
            cluster.address = c.scheduler.address
            for _ in range(n):
                cluster.add_worker()
            c.wait_for_workers(n, timeout=120)
        yield cluster
    finally:
        cluster.close()


def node_loss(p: dict) -> dict:
    """A whole Dask worker (nanny and worker process) is SIGKILLed at rank 1's step 7; a third,
    spare worker takes its place."""
    events = os.path.join(p["workdir"], "events.jsonl")
    cfg = {
        "steps": 10,
        "events": events,
        "checkpoint_every": 5,
        "report_every": 0,
        "faults": [fault(p, "node")],
    }
    with dask_cluster(p["workdir"], 3) as cluster:
        address = cluster.address
        run = call_flow("node-loss", cfg, p, cluster=ft_train.ClusterConfig(address=address))
    return {"run": run, "events": read_events(events)}


def cold_start(p: dict) -> dict:
    """From the flow call to the first completed step (the harness sets PREFECT_API_URL or not)."""
    t0 = time.time()
    import flows.train  # noqa: F401  (the import is timed apart from the call)

    t_import = time.time() - t0
    events = os.path.join(p["workdir"], "events.jsonl")
    run = call_flow("cold-start", {"steps": 3, "events": events}, p)
    return {"run": run, "import_s": t_import, "events": read_events(events)}


def steady(p: dict) -> dict:
    """Report metrics every step; steps/s and report() blocking time. `poll_preemption`: also
    get_preemption_info() after every step (bench/report_cost.py)."""
    events = os.path.join(p["workdir"], "events.jsonl")
    cfg = {"steps": p["steps"], "events": events, "report_every": p.get("report_every", 1)}
    if p.get("poll_preemption"):
        cfg["poll_preemption"] = True
    run = call_flow("steady", cfg, p)
    return {"run": run, "events": read_events(events)}


def checkpoint(p: dict) -> dict:
    events = os.path.join(p["workdir"], "events.jsonl")
    cfg = {
        "steps": p["every"] * p["count"],
        "events": events,
        "checkpoint_every": p["every"],
        "checkpoint_bytes": p["bytes"],
        "report_every": 0,
        "upload": p["mode"],
        "serialise": True,
        "settle": True,
        "staging": p.get("staging", True),
    }
    run = call_flow(f"ckpt-{uuid.uuid4().hex[:6]}", cfg, p)
    return {"run": run, "events": read_events(events)}


def rehydrate(p: dict) -> dict:
    """prepare_run (what a rerun does first) against a run with N committed checkpoints.

    The history is built as a run builds it: N commits through `CheckpointManager.commit`
    (`num_to_keep=None`, so all are kept), each after a rank's upload of one tiny file. So the
    run state is what N commits leave: the head, plus the sealed checkpoint index when N exceeds
    `INDEX_CHUNK`. Not measured; only `prepare_run` is."""
    import gc
    import statistics

    from ft_train.driver.prepare import prepare_run
    from ft_train.storage.checkpoint_manager import CheckpointManager, checkpoint_dir_name
    from ft_train.storage.fs import Storage
    from ft_train.storage.run_state import AttemptRecord, RunState, RunStore
    from ft_train.worker.rank import load_train_loop

    path, opts = storage_target(p)
    local = os.path.join(p["workdir"], "ckpt")
    os.makedirs(local, exist_ok=True)
    with open(os.path.join(local, "w.pt"), "wb") as f:
        f.write(b"w" * 64)
    out = {}
    for n in p["ns"]:
        name = f"rehydrate-{n}"
        storage = Storage(path, opts)
        store = RunStore(storage, name)
        attempt_id = uuid.uuid4().hex
        state = RunState(
            name=name, attempts=[AttemptRecord(attempt=0, attempt_id=attempt_id, world_size=2)]
        )
        store.save(state)
        manager = CheckpointManager(storage, store, ft_train.CheckpointConfig(num_to_keep=None))
        for i in range(1, n + 1):
            dir_name = checkpoint_dir_name(i, 0, attempt_id)
            files = storage.upload_dir(local, f"{name}/{dir_name}")  # what report() uploads
            manager.commit(
                state, dir_name, i, {"step": i, "loss": 1.0 / i, "t": time.time()}, files, attempt=0
            )
        state.status = "interrupted"  # the driver stopped; the rerun resumes it
        store.save(state)
        latest, head_entries, sealed = state.latest, len(state.checkpoints), state.sealed_chunks
        del state, manager  # a rerun starts with none of it in memory
        # Nor with the N commits' writes still being flushed to disk: the fsync of prepare_run's
        # save would pay for them. A rerun comes after the previous driver has stopped.
        os.sync()
        raw = storage.read_bytes(store.path)
        times = []
        run_config = ft_train.RunConfig(name=name, storage_path=path, storage_options=opts)
        load_train_loop(TRAIN_LOOP)  # importing the training function is not finding the state
        for _ in range(p["repeat"]):
            storage.write_atomic(store.path, raw)  # the same head each time
            gc.collect()
            t0 = time.perf_counter()
            plan = prepare_run(
                TRAIN_LOOP,
                {},
                ft_train.ScalingConfig(num_workers=2),
                run_config,
                log=lambda s: None,
            )
            times.append(time.perf_counter() - t0)
            plan.release()  # the run's lease: as the driver's end does (not measured)
            assert plan.state.latest == latest
        assert len(RunStore(storage, name).all_checkpoints(plan.state)) == n  # not measured
        out[str(n)] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "state_bytes": len(raw),
            "head_entries": head_entries,
            "sealed_chunks": sealed,
        }
    return {"rehydrate": out}


def goodput(p: dict) -> dict:
    """One run of `bench.goodput` (it says what p holds), on a cluster of three `dask worker`s
    (one spare); a lost worker's place is taken by a new one at once."""
    from bench.goodput import Injector, loop_config

    cfg = loop_config(p, report_every=1)
    with dask_cluster(p["workdir"], 3) as cluster:
        with Injector(cfg, p, replace_node=lambda: cluster.add_worker(new_node=True)) as injector:
            run = call_flow(
                "goodput",
                cfg,
                p,
                cluster=ft_train.ClusterConfig(address=cluster.address),
                max_failures=-1,
                snapshot_every=p.get("snapshot_every"),
            )
    events = read_events(cfg["events"])
    return {
        "run": run,
        "events": events,
        "faults": injector.faults,
        "injector_error": injector.error,
    }


def warm(p: dict) -> dict:
    """One trivial flow run: creates Prefect's database under PREFECT_HOME (not measured)."""
    from prefect import flow

    @flow(name="bench-warm")
    def noop() -> None:
        pass

    noop()
    return {}


FIGURES = {
    f.__name__: f
    for f in (warm, recovery, node_loss, cold_start, steady, checkpoint, rehydrate, goodput)
}


def main() -> None:
    figure, params, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    result = FIGURES[figure](params)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
