"""torchft's side of the goodput benchmark: the same workload in two replica groups that heal
from each other.

    python -m bench.torchft_side goodput PARAMS_JSON OUT_JSON     (a measurement, by bench.goodput)
    python -m bench.torchft_side rank CONFIG_JSON                 (one replica's rank, by torchrun)

torchft (`torchft==0.2.0`, in a venv of its own beside Ray; bench/README.md) keeps training
through a failure: a `Manager` per replica group asks its lighthouse for a quorum every step, the
gradients are averaged over the replicas in it (`torchft.DistributedDataParallel` over a gloo
process group that is reconfigured on every change), a step during which a replica failed is
thrown away (`OptimizerWrapper.step` commits only when every member could), and a replica that
comes back is sent the model and optimizer state by a live one (HTTP) before its first step.

Laid out as its examples run it (torchft's README, `torchft/torchx.py`): the lighthouse binary of
the wheel (`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`) on
loopback, and two replica groups of one rank each, each under its own `torchrun --nnodes=1
--nproc_per_node=1 --max_restarts=N`, whose agent restarts the rank when it dies or raises. When
a "node" fault kills the agent with its rank, the bench starts a new `torchrun` for that group at
once, as TorchX or a cluster scheduler restarts a failed role (`Groups.replace_lost`, the
injector's `replace_node`). The rank's process group is torchft's `ProcessGroupGloo` with the
5 s timeout of its DDP example; the Manager's other settings are its defaults.

Replica group i is the workload's rank i in the event log. A replica that starts restores
nothing from storage (its state comes from the live replica, the point of the design); replica
0's rank still saves a checkpoint every `checkpoint_every` steps into local storage
synchronously, as a torchft user keeps one for the loss of every replica at once (these faults
never take both).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta

from bench.workload import Api, read_events, run_loop

REPLICAS = 2
MAX_RESTARTS = 1000  # torchrun's restarts of a group's rank; every fault here is one
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
PG_TIMEOUT_S = 5  # torchft's DDP example's ProcessGroupGloo timeout


class TorchftApi(Api):
    system = "torchft"
    async_owns_dir = False

    def __init__(self, replica: int, storage: str):
        self.replica, self.storage = replica, storage
        self.manager = None
        self.raw = None
        self.last = 0  # the manager's step before the optimizer step

    def rank(self) -> int:
        return self.replica

    def prepare_model(self, model):
        from torchft import Manager, ProcessGroupGloo

        self.raw = model
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=PG_TIMEOUT_S)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            replica_id=f"bench_{self.replica}",
        )
        return _ddp()(self.manager, model)

    def prepare_optimizer(self, opt):
        from torchft import Optimizer  # torchft.optim.OptimizerWrapper

        def load(state: dict) -> None:
            self.raw.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])

        def save() -> dict:
            return {"model": self.raw.state_dict(), "optimizer": opt.state_dict()}

        self.manager.register_state_dict_fn("train", load, save)
        return Optimizer(self.manager, opt)

    def step_done(self, step: int) -> int | None:
        """The manager's step: one more than before where the step was committed; a replica
        that healed jumps to its peer's."""
        now = self.manager.current_step()
        if now <= self.last:
            return None
        self.last = now
        return now

    def step_fields(self) -> dict:
        return {"n": self.manager.num_participants()}

    @contextlib.contextmanager
    def checkpoint_dir(self) -> Iterator[str | None]:
        yield None  # healed from the live replica, not restored from storage

    @contextlib.contextmanager
    def save_dir(self, nbytes: int, taken_over: bool) -> Iterator[str]:
        os.makedirs(self.storage, exist_ok=True)
        yield tempfile.mkdtemp(prefix="tmp-", dir=self.storage)

    def report(self, metrics: dict, checkpoint_dir: str | None, mode: str) -> None:
        """Rank 0's checkpoint: the saved directory becomes the latest, the older one goes."""
        if checkpoint_dir is None:
            return
        final = os.path.join(self.storage, f"checkpoint_{metrics['step']:09d}")
        os.rename(checkpoint_dir, final)
        for name in os.listdir(self.storage):
            if name != os.path.basename(final):
                shutil.rmtree(os.path.join(self.storage, name), ignore_errors=True)


def _ddp() -> type:
    """torchft's DistributedDataParallel, with its gradient hook's error path mended.

    In torchft 0.2.0 the hook asserts on the future of an allreduce that failed
    (`assert fut._fut` in `torchft/ddp.py`: `_ManagedWork.wait` reports the error to the
    manager and returns False before it sets that future), so the survivor of a peer that died
    during an allreduce raised AssertionError (and, for the next bucket, AttributeError: the
    manager, errored, returns a finished work with a plain future), and torchrun restarted it
    too: both replicas then started again from step 0. Here a failed allreduce hands DDP the
    bucket as it is; the
    manager has recorded the error, so `should_commit` throws the step away, which is what
    torchft's design does with it."""
    import torch
    from torchft import DistributedDataParallel

    class Mended(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            ok = work.wait()
            fut = work.get_future()
            # torchft's own hook returns the inner future; once the manager has errored,
            # allreduce returns a finished work whose future is a plain one
            inner = getattr(fut, "_fut", fut)
            if ok and inner is not None:
                return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return Mended


def rank_main(config: dict) -> None:
    """One replica group's rank, under torchrun (it sets MASTER_ADDR/PORT, RANK, WORLD_SIZE)."""
    if os.path.exists(os.path.join(config["control"], "stop")):
        return  # restarted after the run ended: no peer to heal from, nothing left to train
    api = TorchftApi(int(os.environ["REPLICA_GROUP_ID"]), config["storage"])
    run_loop(config, api)
    api.manager.shutdown(wait=False)
    # the manager's threads keep the interpreter from exiting; the events are written (each
    # with one write()), so the process ends here, with success for torchrun
    os._exit(0)


# -- the measurement -------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Groups:
    """The lighthouse and the replica groups' torchruns, each in a process group of its own."""

    def __init__(self, cfg: dict, workdir: str):
        self.cfg, self.workdir = cfg, workdir
        self.bin = os.path.dirname(sys.executable)
        self.log = open(os.path.join(workdir, "torchft.log"), "ab")
        port = _free_port()
        self.lighthouse = subprocess.Popen(
            [os.path.join(self.bin, "torchft_lighthouse"), *LIGHTHOUSE_FLAGS]
            + ["--bind", f"127.0.0.1:{port}"],
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )
        self.env = dict(
            os.environ,
            TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
            NUM_REPLICA_GROUPS=str(REPLICAS),
            CUDA_VISIBLE_DEVICES="",
        )
        self.procs: dict[int, subprocess.Popen] = {}
        self.replaced: list[subprocess.Popen] = []  # lost groups' torchruns, reaped at the end

    def start(self, replica: int, new_node: bool = False) -> dict | None:
        """`replica`'s torchrun, on a fresh store port; `new_node`: started as
        `bench.goodput.start_node` starts a node in place of a lost one."""
        from bench.goodput import start_node

        cmd = [
            os.path.join(self.bin, "torchrun"),
            "--nnodes=1",
            "--nproc_per_node=1",
            f"--max_restarts={MAX_RESTARTS}",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            "-m",
            "bench.torchft_side",
            "rank",
            json.dumps(self.cfg),
        ]
        kw = dict(
            env={**self.env, "REPLICA_GROUP_ID": str(replica)},
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )
        proc, record = start_node(cmd, **kw) if new_node else (subprocess.Popen(cmd, **kw), None)
        self.procs[replica] = proc
        return record

    def replace_lost(self) -> dict:
        """After a node fault: a new torchrun for each group whose torchrun is gone (the fault
        SIGKILLed it; waited for up to 10 s)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lost = [r for r, p in self.procs.items() if p.poll() is not None]
            if lost:
                break
            time.sleep(0.02)  # the kill is delivered; its exit is being reaped
        else:
            return {"error": "no torchrun had exited"}
        records = {}
        for r in lost:
            self.replaced.append(self.procs[r])
            records[r] = self.start(r, new_node=True)
        return {"replicas": records}

    def wait(self, stop: str, timeout: float) -> dict:
        """Until every group's torchrun has exited after the stop file was written: those that
        are not done 30 s after the first one finished are stopped (a replica that came back
        after the last peer stopped would train alone from step 0). {replica: exit status}."""
        deadline, first_done = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            rcs = {r: p.poll() for r, p in self.procs.items()}
            if os.path.exists(stop) and all(rc == 0 for rc in rcs.values()):
                return rcs
            if first_done is None and 0 in rcs.values():
                first_done = time.monotonic()
            if first_done is not None and time.monotonic() > first_done + 30:
                break
            time.sleep(0.2)  # a bounded wait on the groups' exits
        return {r: p.poll() for r, p in self.procs.items()}

    def close(self) -> None:
        import psutil

        procs = [*self.procs.values(), *self.replaced, self.lighthouse]
        ranks = []  # torchrun starts each rank in a session of its own
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                ranks += psutil.Process(proc.pid).children(recursive=True)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own process groups
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
        for proc in procs:
            proc.wait()
        self.log.close()


def goodput(p: dict) -> dict:
    """One run of `bench.goodput` (it says what p holds): the lighthouse and two replica
    groups; checkpoints every `p["checkpoint_every"]` steps (0: none) into local storage."""
    from bench.goodput import Injector, loop_config

    cfg = loop_config(p, report_every=0)
    cfg["storage"] = os.path.join(p["workdir"], "storage")
    t_call = time.time()
    groups = Groups(cfg, p["workdir"])
    try:
        for r in range(REPLICAS):
            groups.start(r)
        injector = Injector(cfg, p, replace_node=groups.replace_lost, partial_restart=True)
        with injector:
            rcs = groups.wait(os.path.join(cfg["control"], "stop"), p["duration_s"] + 600)
    finally:
        groups.close()
    events = read_events(cfg["events"])
    with open(os.path.join(p["workdir"], "torchft.log"), errors="replace") as f:
        tail = f.read()[-3000:]
    ok = all(rc == 0 for rc in rcs.values())
    return {
        "run": {
            "t_call": t_call,
            "t_return": time.time(),
            "status": "finished" if ok else "failed",
        },
        "exit": rcs,
        "events": events,
        "faults": injector.faults,
        "injector_error": injector.error,
        "log_tail": None if ok else tail,
    }


def main() -> None:
    if sys.argv[1] == "rank":
        rank_main(json.loads(sys.argv[2]))
        return
    figure, params, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    result = {"goodput": goodput}[figure](params)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
