"""The training workload every system runs, and the event log it writes.

One loop, `run_loop`, is shared by ft-train, Ray Train, torchft and bare torch.distributed: only
the adapter (`Api`) that wraps the system's model and optimizer preparation, checkpoint lookup and
report() differs. So they measure the same model (`config["workload"]`: "mlp", a 4.2M-parameter
MLP with SGD, the default; or "transformer", `bench.transformer`'s decoder with AdamW), DDP over
gloo, the same batches, the same checkpoint contents and the same fault points.

Each rank appends one JSON line per event to `config["events"]` (O_APPEND, one write per line, so
the lines of two ranks never interleave). Times are wall-clock `time.time()` so that events from
the harness, the driver and the ranks share one clock; durations inside a rank use perf_counter.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
from torch import nn

BATCH = 64
IN, HIDDEN, OUT = 1024, 2048, 10


def build_model() -> nn.Module:
    """4 207 626 parameters (16.8 MB of float32)."""
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN), nn.ReLU(), nn.Linear(IN, OUT)
    )


def build(workload: str) -> tuple[nn.Module, Callable, Callable, int]:
    """(model, make_optimizer(params), batch(generator) -> (inputs, targets), samples a rank
    trains a step) of the workload named `workload`."""
    if workload == "transformer":
        from bench import transformer

        return transformer.build()
    if workload != "mlp":
        raise ValueError(f"workload {workload!r}: choose mlp or transformer")

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)

    def make_opt(params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    return build_model(), make_opt, batch, BATCH


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class Events:
    """Appends events of one rank to the run's JSONL file."""

    def __init__(self, path: str | None, system: str, rank: int):
        self.system, self.rank = system, rank
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def emit(self, event: str, t: float | None = None, **fields: Any) -> None:
        if self.fd is None:
            return
        rec = {
            "sys": self.system,
            "rank": self.rank,
            "event": event,
            "t": t or time.time(),
            **fields,
        }
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def read_events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Api:
    """What differs between the systems. Every method is called on every rank."""

    system = "none"
    # With mode "async", whether report() takes the checkpoint directory over and deletes it
    # (Ray); if not (ft-train), the loop deletes it after report() returns, as with "sync"
    # (timed as cleanup, part of the stall).
    async_owns_dir = True

    def rank(self) -> int:
        raise NotImplementedError

    def prepare_model(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def prepare_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps (torchft wraps it; the others use it as it is)."""
        return opt

    def step_done(self, step: int) -> int | None:
        """After the optimizer step of `step`: the step the system has now completed, as it
        counts them, or None where it threw the step away (torchft: a peer failed during it;
        the loop trains it again). Every other system completes the step it was given."""
        return step

    def step_fields(self) -> dict:
        """Extra fields of each "step" event (torchft: how many replicas took part)."""
        return {}

    def checkpoint_dir(self) -> ContextManager[str | None]:
        """The latest committed checkpoint as a local directory, or None."""
        raise NotImplementedError

    def report(self, metrics: dict, checkpoint_dir: str | None, mode: str) -> None:
        """mode: "sync" or "async". With "async" and `async_owns_dir` the system owns and
        deletes `checkpoint_dir`; otherwise the caller deletes it after report() returns."""
        raise NotImplementedError

    def use_snapshots(self, files: Callable[[], dict], jit: Callable[[], dict]) -> None:
        """Hand the system's in-memory snapshot tier `files()`, this rank's {file name: state}
        now, for its periodic snapshots, and `jit()`, the same for every rank, for a
        just-in-time save when a peer fails."""
        raise NotImplementedError(f"{self.system} has no in-memory snapshots")

    def preemption_info(self) -> Any:
        """The system's get_preemption_info(): None, or what it says of a notice."""
        raise NotImplementedError(f"{self.system} has no get_preemption_info()")

    def wait_committed(self, config: dict, step: int) -> None:
        """Block until the checkpoint reported at `step` is committed (before a fault fires, so
        that every system restores the same checkpoint)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def save_dir(self, nbytes: int, taken_over: bool) -> Iterator[str]:
        """A fresh directory to save a checkpoint of `nbytes` into, removed after report()
        unless the system took it over. Default: a temporary directory, as Ray's guide does."""
        d = tempfile.mkdtemp(prefix="bench-ckpt-")
        yield d
        if not taken_over:
            shutil.rmtree(d, ignore_errors=True)


def _pad(nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (max(nbytes, 0),), dtype=torch.uint8, generator=g)


def checkpoint_state(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, pad: torch.Tensor | None
) -> dict:
    raw = getattr(model, "module", model)
    state = {"model": raw.state_dict(), "optimizer": opt.state_dict(), "step": step}
    if pad is not None:
        state["pad"] = pad
    return state


def serialise_s(state: dict, repeat: int = 2) -> float:
    """The reference: torch.save of the same state into memory (best of `repeat`)."""
    best = float("inf")
    for _ in range(repeat):
        buf = io.BytesIO()
        t0 = time.perf_counter()
        torch.save(state, buf)
        best = min(best, time.perf_counter() - t0)
        del buf
    return best


def _fault(config: dict, api: Api, rank: int, step: int, ev: Events) -> None:
    """The fault points: "kill" SIGKILLs this rank's process; "node" SIGKILLs its node
    (`node_processes`: the Dask nanny / the Ray raylet) and then itself. Each fires once (a
    marker file), after the latest checkpoint is committed (its step is `step - 2`)."""
    for f in config.get("faults", ()):
        if f["rank"] != rank or f["step"] != step:
            continue
        try:
            os.close(os.open(f["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        every = config.get("checkpoint_every", 0)
        if every:
            api.wait_committed(config, (step - 1) // every * every)
        node, parent = node_processes(os.getpid())  # which processes a "node" kill takes down
        ev.emit("kill", kind=f["kind"], step=step, pid=os.getpid(), ppid=node[0], parent=parent)
        if f["kind"] == "node":
            kill_node(node)  # this process last
        os.kill(os.getpid(), signal.SIGKILL)


def _parent(pid: int) -> tuple[int, str]:
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        return ppid, f.read().replace(b"\0", b" ").decode(errors="replace")[:120]


def node_processes(pid: int) -> tuple[list[int], str]:
    """The processes whose loss is the loss of rank `pid`'s node, the rank's last, and the node's
    own process's command line: the rank's parent (Ray's raylet, a Dask nanny); where that parent
    is a nanny's fork server, the nanny and the server. Killing the server alone would leave the
    nanny to start a new server and worker, on a node that was meant to be gone."""
    parent, cmd = _parent(pid)
    if "multiprocessing.forkserver" not in cmd:
        return [parent, pid], cmd
    nanny, cmd = _parent(parent)
    return [nanny, parent, pid], cmd


def kill_node(procs: list[int]) -> None:
    """SIGKILL `node_processes`' list, in its order: ProcessLookupError if the node's own process
    is gone already; a fork server gone by then (it ends with its nanny) is passed over."""
    os.kill(procs[0], signal.SIGKILL)
    for p in procs[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _control(control: str, rank: int, step: int, stop_at: int | None, ev: Events) -> int | None:
    """The harness's files in the directory `control`, looked at before every step: `raise-RANK`
    makes that rank raise (once: the rank deletes it), `stop` holds the last step to train (the
    harness writes it with a margin, so every rank reads it before that step)."""
    try:
        os.unlink(os.path.join(control, f"raise-{rank}"))
    except FileNotFoundError:
        pass
    else:
        ev.emit("raise", step=step - 1)
        raise RuntimeError(f"injected exception on rank {rank} before step {step}")
    if stop_at is None and os.path.exists(stop := os.path.join(control, "stop")):
        with open(stop) as f:
            return int(f.read())
    return stop_at


def run_loop(config: dict, api: Api) -> None:
    """The training loop. Config keys: steps, events, checkpoint_every (0: never),
    checkpoint_bytes (total size of a checkpoint; rank 0 writes it), report_every (0: only with
    checkpoints), upload ("sync"/"async"), faults, serialise (measure the in-memory reference
    before the first checkpoint), settle (wait for each checkpoint's commit before the next),
    control (a directory of the harness's files, `_control`), snapshot (offer the system's
    in-memory snapshot tier the state: rank 0's at every report, and every rank's just in
    time), poll_preemption (call the system's get_preemption_info() after every optimizer step,
    as Ray's pattern does; only measured: a notice is logged, nothing is saved)."""
    torch.set_num_threads(1)  # two ranks on two cores: one core each, in every system
    rank = api.rank()
    ev = Events(config.get("events"), api.system, rank)
    ev.emit("start", pid=os.getpid())
    torch.manual_seed(0)
    built, make_opt, batch, _ = build(config.get("workload", "mlp"))
    model = api.prepare_model(built)
    opt = api.prepare_optimizer(make_opt(model.parameters()))
    raw = getattr(model, "module", model)

    start, restored = 0, False
    with api.checkpoint_dir() as d:
        if d is not None:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
            raw.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start, restored = state["step"], True
    if restored:
        ev.emit("restored", step=start)
    ev.emit("ready")

    g = torch.Generator().manual_seed(100 + rank)
    x, y = batch(g)
    every, report_every = config.get("checkpoint_every", 0), config.get("report_every", 1)
    mode = config.get("upload", "sync")
    pad = None
    if every and rank == 0:
        # model + optimizer (SGD with momentum: twice the parameters' bytes; the MLP's are
        # 33.7 MB); pad the checkpoint up to the asked size
        base = 2 * 4 * n_params(raw)
        pad = (
            _pad(config.get("checkpoint_bytes", 0) - base)
            if config.get("checkpoint_bytes")
            else None
        )
    report_s: list[float] = []
    done = start  # the last step whose optimizer step completed: what a snapshot holds

    def snapshot() -> dict:
        return {"state.pt": checkpoint_state(model, opt, done, None)} if rank == 0 else {}

    def jit() -> dict:
        return {"state.pt": checkpoint_state(model, opt, done, None)}

    if config.get("snapshot"):
        # any survivor may be the one that saves just in time; a restore takes the lowest rank's
        api.use_snapshots(snapshot, jit)
    control, stop_at = config.get("control"), None
    poll, noticed = config.get("poll_preemption", False), False

    step = start
    while step < config["steps"]:
        if control:
            stop_at = _control(control, rank, step + 1, stop_at, ev)
            if stop_at is not None and step + 1 > stop_at:
                break
        _fault(config, api, rank, step + 1, ev)
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        completed = api.step_done(step + 1)
        if completed is None:  # thrown away by the system: trained again
            ev.emit("discard", step=step + 1)
            continue
        step = done = completed
        if poll and api.preemption_info() is not None and not noticed:
            noticed = True
            ev.emit("preemption_notice", step=step)
        t = time.time()
        ev.emit("step", t=t, step=step, restored=restored, **api.step_fields())
        metrics = {"step": step, "loss": loss.item(), "t": t}
        if every and step % every == 0:
            if step > every and config.get("settle"):
                # Not timed: the previous checkpoint is committed (an async upload is done), so
                # each checkpoint is measured with nothing else in flight.
                api.wait_committed(config, step - every)
            elif step == every and config.get("serialise") and rank == 0:
                ev.emit("serialise", s=serialise_s(checkpoint_state(model, opt, step, pad)))
            t0 = time.perf_counter()
            taken_over = mode == "async" and api.async_owns_dir and rank == 0
            with api.save_dir(config.get("checkpoint_bytes", 0), taken_over) as d:
                nbytes = 0
                if rank == 0:
                    torch.save(checkpoint_state(model, opt, step, pad), os.path.join(d, "state.pt"))
                    nbytes = os.path.getsize(os.path.join(d, "state.pt"))
                t1 = time.perf_counter()
                api.report(metrics, d if rank == 0 else None, mode)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            ev.emit(
                "ckpt",
                step=step,
                save_s=t1 - t0,
                report_s=t2 - t1,
                cleanup_s=t3 - t2,
                stall_s=t3 - t0,
                mode=mode,
                bytes=nbytes,
            )
        elif report_every and step % report_every == 0:
            t0 = time.perf_counter()
            api.report(metrics, None, mode)
            report_s.append(time.perf_counter() - t0)
    if report_s:
        ev.emit("reports", durations=report_s)
    ev.emit("end")


# -- figures from events ---------------------------------------------------------------------


def first_restored_step(events: list[dict], after: float) -> dict | None:
    """The first training step completed by every rank after a restore (the latest rank's time)."""
    steps = [e for e in events if e["event"] == "step" and e.get("restored") and e["t"] >= after]
    if not steps:
        return None
    first = min(e["step"] for e in steps)
    return max((e for e in steps if e["step"] == first), key=lambda e: e["t"])


def recovery_s(events: list[dict]) -> float | None:
    kills = [e for e in events if e["event"] == "kill"]
    if not kills:
        return None
    t_kill = kills[0]["t"]
    first = first_restored_step(events, t_kill)
    return None if first is None else first["t"] - t_kill


def detection_s(events: list[dict], failures: list) -> float | None:
    """From the kill to the time the driver recorded the failure (ft-train's run state: the
    failure is recorded once every rank has stopped, so this bounds detection from above)."""
    kills = [e["t"] for e in events if e["event"] == "kill"]
    recorded = [f[3] for f in failures if len(f) > 3]
    return recorded[0] - kills[0] if kills and recorded else None


def first_step_t(events: list[dict]) -> float | None:
    """When step 1 was completed by every rank."""
    ts = [e["t"] for e in events if e["event"] == "step" and e["step"] == 1]
    return max(ts) if ts else None


def throughput(events: list[dict], warmup: int) -> float | None:
    """Steps per second on rank 0 from step `warmup` to its last step (first attempt only)."""
    steps = sorted(
        (e["step"], e["t"])
        for e in events
        if e["event"] == "step" and e["rank"] == 0 and not e.get("restored")
    )
    steps = [s for s in steps if s[0] >= warmup]
    if len(steps) < 2:
        return None
    return (steps[-1][0] - steps[0][0]) / (steps[-1][1] - steps[0][1])


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def report_stats(events: list[dict], skip: int = 2) -> dict | None:
    """Per-call blocking time of metrics-only report(), over every rank (the first `skip` calls
    of each rank are left out: the first call of a system may set things up)."""
    durs = [d for e in events if e["event"] == "reports" for d in e["durations"][skip:]]
    if not durs:
        return None
    return {
        "median_ms": statistics.median(durs) * 1e3,
        "p99_ms": percentile(durs, 0.99) * 1e3,
        "mean_ms": statistics.fmean(durs) * 1e3,
        "max_ms": max(durs) * 1e3,
        "calls": len(durs),
    }


def stall_stats(events: list[dict]) -> dict | None:
    """Rank 0's blocked time per checkpoint (median over the run's checkpoints)."""
    ck = [e for e in events if e["event"] == "ckpt" and e["rank"] == 0]
    if not ck:
        return None
    med = lambda k: statistics.median(e[k] for e in ck)  # noqa: E731
    other = [e["stall_s"] for e in events if e["event"] == "ckpt" and e["rank"] != 0]
    ser = [e["s"] for e in events if e["event"] == "serialise"]
    return {
        "stall_s": med("stall_s"),
        "save_s": med("save_s"),
        "report_s": med("report_s"),
        "cleanup_s": med("cleanup_s"),
        "other_rank_stall_s": statistics.median(other) if other else None,
        "serialise_s": ser[0] if ser else None,
        "checkpoints": len(ck),
    }
