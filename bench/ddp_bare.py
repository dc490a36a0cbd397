"""The baseline: the same loop on torch.distributed directly, two processes, gloo, no framework.

python -m bench.ddp_bare FIGURE PARAMS_JSON OUT_JSON      (FIGURE: steady, goodput)
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from bench.workload import Api, read_events, run_loop


class BareApi(Api):
    system = "ddp"

    def rank(self) -> int:
        return dist.get_rank()

    def prepare_model(self, model):
        return DistributedDataParallel(model)

    @contextlib.contextmanager
    def checkpoint_dir(self) -> Iterator[str | None]:
        yield None

    def report(self, metrics: dict, checkpoint_dir: str | None, mode: str) -> None:
        pass  # no framework: nothing to report to


def _rank(rank: int, port: int, config: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run_loop(config, BareApi())
    finally:
        dist.destroy_process_group()


def steady(p: dict) -> dict:
    events = os.path.join(p["workdir"], "events.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"steps": p["steps"], "events": events, "report_every": 1}
    t_call = time.time()
    mp.spawn(_rank, args=(port, cfg), nprocs=2, join=True)
    return {
        "run": {"t_call": t_call, "t_return": time.time(), "status": "finished"},
        "events": read_events(events),
    }


def goodput(p: dict) -> dict:
    """`bench.goodput`'s baseline: the same loop and workload without faults, for
    `p["duration_s"]` from the first step (the injector's stop), its samples/s the measure
    of every system's goodput."""
    from bench.goodput import Injector, loop_config

    cfg = loop_config({**p, "checkpoint_every": 0}, report_every=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t_call = time.time()
    with Injector(cfg, {**p, "fault_every_s": 0}, replace_node=lambda: None) as injector:
        mp.spawn(_rank, args=(port, cfg), nprocs=2, join=True)
    return {
        "run": {"t_call": t_call, "t_return": time.time(), "status": "finished"},
        "events": read_events(cfg["events"]),
        "faults": [],
        "injector_error": injector.error,
    }


def main() -> None:
    figure, params, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    result = {"steady": steady, "goodput": goodput}[figure](params)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
