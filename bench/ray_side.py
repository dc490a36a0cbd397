"""Ray Train V2's side of the benchmark: the same workload under `TorchTrainer.fit()`.

Run by `bench.run` in a fresh process per measurement (RAY_TRAIN_V2_ENABLED=1 is set there):
    python -m bench.ray_side FIGURE PARAMS_JSON OUT_JSON
Ray runs with its defaults (e.g. RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2), as a user gets it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

from bench.workload import Api, read_events, run_loop


class RayApi(Api):
    system = "ray"

    def rank(self) -> int:
        import ray.train

        return ray.train.get_context().get_world_rank()

    def prepare_model(self, model):
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    @contextlib.contextmanager
    def checkpoint_dir(self) -> Iterator[str | None]:
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            yield None
        else:
            with ckpt.as_directory() as d:
                yield d

    def report(self, metrics: dict, checkpoint_dir: str | None, mode: str) -> None:
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        upload = (
            ray.train.CheckpointUploadMode.ASYNC
            if mode == "async"
            else ray.train.CheckpointUploadMode.SYNC
        )
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=upload)

    def wait_committed(self, config: dict, step: int) -> None:
        import ray.train

        ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED
        )


def train_loop(config: dict) -> None:
    run_loop(config, RayApi())


# -- helpers ---------------------------------------------------------------------------------


def storage_target(p: dict):
    """(storage_path, storage_filesystem): a local directory, or a fresh bucket on the loopback
    S3 through pyarrow's S3 filesystem (Ray's own)."""
    if p.get("storage", "local") == "local":
        return os.path.join(p["workdir"], "storage"), None
    import pyarrow.fs
    import s3fs

    bucket = f"ray-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(
        skip_instance_cache=True, endpoint_url=p["s3_endpoint"], key="testing", secret="testing"
    ).mkdir(bucket)
    fs = pyarrow.fs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        endpoint_override=p["s3_endpoint"].split("://", 1)[1],
        scheme="http",
    )
    return f"{bucket}/runs", fs


def fit(name: str, config: dict, p: dict, max_failures: int = 1) -> dict:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    path, fs = storage_target(p)
    trainer = TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=path,
            storage_filesystem=fs,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
        ),
        torch_config=TorchConfig(backend="gloo"),
    )
    t_call = time.time()
    result = trainer.fit()
    t_return = time.time()
    return {
        "t_call": t_call,
        "t_return": t_return,
        "status": "finished" if result.error is None else "failed",
    }


def fault(p: dict, kind: str, rank: int = 1, step: int = 7) -> dict:
    return {
        "rank": rank,
        "step": step,
        "kind": kind,
        "marker": os.path.join(p["workdir"], f"fault-{uuid.uuid4().hex[:6]}"),
    }


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


# -- figures ---------------------------------------------------------------------------------


def recovery(p: dict) -> dict:
    events = os.path.join(p["workdir"], "events.jsonl")
    cfg = {
        "steps": 10,
        "events": events,
        "checkpoint_every": 5,
        "report_every": 0,
        "faults": [fault(p, "kill")],
    }
    with local_ray():
        run = fit("recovery", cfg, p)
    return {"run": run, "events": read_events(events)}


@contextlib.contextmanager
def ray_nodes(n: int) -> Iterator:
    """`n` one-CPU Ray nodes (ray.cluster_utils.Cluster) beside a zero-CPU head, and Ray
    initialised on them; yields the Cluster."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        for _ in range(n):
            add_node(cluster)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


NODE_OBJECT_STORE = 200 * 2**20


def add_node(cluster) -> None:
    cluster.add_node(num_cpus=1, object_store_memory=NODE_OBJECT_STORE)


def node_loss(p: dict) -> dict:
    """Three one-CPU Ray nodes (`ray_nodes`); rank 1 kills its node's raylet, then its own
    process, at step 7."""
    events = os.path.join(p["workdir"], "events.jsonl")
    cfg = {
        "steps": 10,
        "events": events,
        "checkpoint_every": 5,
        "report_every": 0,
        "faults": [fault(p, "node")],
    }
    with ray_nodes(3):
        run = fit("node-loss", cfg, p)
    return {"run": run, "events": read_events(events)}


def goodput(p: dict) -> dict:
    """One run of `bench.goodput` (it says what p holds), on three one-CPU Ray nodes (one
    spare); a lost node's place is taken by a new one at once (`ray start`: Cluster.add_node
    works only on the main thread, which fit() holds). Reports only with checkpoints: a Ray
    report() costs up to its controller's 2 s poll once its one-slot queue is full."""
    from bench.goodput import Injector, loop_config
    from bench.goodput import start_node as start_node_as_new

    cfg = loop_config(p, report_every=0)
    joined: list[subprocess.Popen] = []
    log = open(os.path.join(p["workdir"], "ray-start.log"), "ab")

    def start_node() -> dict:
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        args = [
            f"--address={cluster.address}",
            "--num-cpus=1",
            f"--object-store-memory={NODE_OBJECT_STORE}",
        ]
        # --block: the node's processes stay in the group started here, and go with it
        cmd = [ray, "start", *args, "--block"]
        proc, record = start_node_as_new(cmd, stdout=log, stderr=log, start_new_session=True)
        joined.append(proc)
        return record

    try:
        with ray_nodes(3) as cluster:
            with Injector(cfg, p, replace_node=start_node) as injector:
                run = fit("goodput", cfg, p, max_failures=-1)
    finally:
        for proc in joined:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own process groups
            proc.wait()
        log.close()
    events = read_events(cfg["events"])
    return {
        "run": run,
        "events": events,
        "faults": injector.faults,
        "injector_error": injector.error,
    }


def cold_start(p: dict) -> dict:
    """fit() until the first completed step: fit() starts Ray itself, or (RAY_ADDRESS set by the
    harness) connects to a Ray cluster that is already running."""
    t0 = time.time()
    import ray.train.torch  # noqa: F401

    t_import = time.time() - t0
    events = os.path.join(p["workdir"], "events.jsonl")
    run = fit("cold-start", {"steps": 3, "events": events}, p)
    return {"run": run, "import_s": t_import, "events": read_events(events)}


def steady(p: dict) -> dict:
    events = os.path.join(p["workdir"], "events.jsonl")
    with local_ray():
        run = fit(
            "steady",
            {"steps": p["steps"], "events": events, "report_every": p.get("report_every", 1)},
            p,
        )
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
    }
    with local_ray():
        run = fit(f"ckpt-{uuid.uuid4().hex[:6]}", cfg, p)
    return {"run": run, "events": read_events(events)}


def rehydrate(p: dict) -> dict:
    """What Ray's controller does on a rerun: a StorageContext (marker check) and a
    CheckpointManager that loads the snapshot and checks every listed checkpoint exists."""
    import gc

    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        CheckpointManager,
        _CheckpointManagerState,
        _TrainingResultState,
    )
    from ray.train.v2._internal.execution.storage import StorageContext

    path, fs = storage_target(p)
    out = {}
    for n in p["ns"]:
        name = f"rehydrate-{n}"
        sc = StorageContext(storage_path=path, experiment_dir_name=name, storage_filesystem=fs)
        results = [
            _TrainingResultState(
                checkpoint_dir_name=f"checkpoint_{i:06d}",
                metrics={"step": i, "loss": 1.0 / i, "t": time.time()},
            )
            for i in range(1, n + 1)
        ]
        snapshot = _CheckpointManagerState(
            checkpoint_results=results,
            checkpoint_report_indices=list(range(1, n + 1)),
            latest_checkpoint_result=results[-1],
            pending_training_results=[],
            pending_validation_specs=[],
            current_report_index=n,
            validated_checkpoint_dir_names=[],
            timed_out_validation_checkpoint_dir_names=[],
            failed_validation_checkpoint_dir_names=[],
        ).json()
        for r in results:  # the directories exist, as in a real run
            d = sc.build_checkpoint_path_from_name(r.checkpoint_dir_name)
            sc.storage_filesystem.create_dir(d)
            with sc.storage_filesystem.open_output_stream(f"{d}/state.pt") as f:
                f.write(b"x")
        with sc.storage_filesystem.open_output_stream(sc.checkpoint_manager_snapshot_path) as f:
            f.write(snapshot.encode())
        size = len(snapshot)
        del results, snapshot  # a rerun starts with none of it in memory
        times = []
        for _ in range(p["repeat"]):
            gc.collect()
            t0 = time.perf_counter()
            sc2 = StorageContext(storage_path=path, experiment_dir_name=name, storage_filesystem=fs)
            manager = CheckpointManager(checkpoint_config=CheckpointConfig(), storage_context=sc2)
            times.append(time.perf_counter() - t0)
            assert manager.latest_checkpoint_result is not None
        out[str(n)] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "state_bytes": size,
        }
    return {"rehydrate": out}


def serve(p: dict) -> dict:
    """Start a Ray cluster and keep it until stdin closes (the 'already running' cold start)."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    print(json.dumps({"address": ray.get_runtime_context().gcs_address}), flush=True)
    sys.stdin.read()
    ray.shutdown()
    return {}


def warm(p: dict) -> dict:
    """Start and stop Ray once (not measured): its binaries are then in the page cache."""
    with local_ray():
        pass
    return {}


FIGURES = {
    f.__name__: f
    for f in (warm, recovery, node_loss, cold_start, steady, checkpoint, rehydrate, serve, goodput)
}


def main() -> None:
    figure, params = sys.argv[1], json.loads(sys.argv[2])
    result = FIGURES[figure](params)
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
