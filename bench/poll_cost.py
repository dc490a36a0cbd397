"""The cost of polling `ft_train.get_preemption_info()` at every step, on 2 gloo ranks.

    python -m bench.poll_cost [--calls 200000] [--step-ms 2]

Two spawned processes, each with a Session on a real control group (as `run_rank` makes it),
measure: a tight loop of polls at the default `agreement_interval_s` (0.25 s) and at 0 (an
agreement at every call, what polling would cost without the interval), and a loop of busy
steps of `--step-ms`, each with a small all-reduce on the default group as DDP's gradient sync,
with and without a poll per step (the overhead a training loop sees).
Prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import tempfile
import time


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rank(rank: int, port: int, calls: int, step_s: float, steps: int, out) -> None:
    import torch
    import torch.distributed as dist

    import ft_train
    from ft_train.protocol import RankSpec
    from ft_train.storage.fs import Storage
    from ft_train.worker import session as session_module
    from ft_train.worker.rank import _control_group
    from ft_train.worker.session import Session

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    base = RankSpec(
        train_loop="unused:fn",
        config={},
        rank=rank,
        world_size=2,
        local_rank=rank,
        local_world_size=2,
        node_rank=0,
        name="bench",
        attempt=0,
        attempt_id="b" * 32,
        master_addr="127.0.0.1",
        master_port=port,
        backend="gloo",
        use_gpu=False,
        storage=Storage(tempfile.mkdtemp()),
        checkpoint_dir=None,
        start_report_index=0,
        topic="unused",
        collective_timeout_s=300.0,
        agreement_interval_s=0.25,
    )
    control = _control_group()
    found: dict = {"rank": rank}

    def session(interval_s: float) -> Session:
        s = Session(dataclasses.replace(base, agreement_interval_s=interval_s), lambda m: None)
        s.control = control
        session_module.install(s)
        return s

    for interval_s, label in ((0.25, "tight_default"), (0.0, "tight_interval0")):
        n = calls if interval_s else calls // 20
        s = session(interval_s)
        ft_train.collective.barrier()
        started = time.perf_counter()
        for _ in range(n):
            ft_train.get_preemption_info()
        elapsed = time.perf_counter() - started
        ft_train.collective.barrier()
        found[label] = {"us_per_call": 1e6 * elapsed / n, "agreements": s.agreements, "calls": n}
    s = session(0.25)
    ft_train.collective.barrier()
    s._next_agreement = 2**62  # no agreement is due: the call's own path only
    started = time.perf_counter()
    for _ in range(calls):
        ft_train.get_preemption_info()
    found["no_agreement_due_us_per_call"] = 1e6 * (time.perf_counter() - started) / calls
    ft_train.collective.barrier()
    per_step: dict[str, list[float]] = {"steps_without_poll": [], "steps_with_poll": []}
    agreements = 0
    for _ in range(3):  # alternated, for the machine's drift
        for poll, label in ((False, "steps_without_poll"), (True, "steps_with_poll")):
            s = session(0.25)
            ft_train.collective.barrier()
            started = time.perf_counter()
            grads = torch.zeros(1024)
            for _ in range(steps):
                _busy(step_s)
                dist.all_reduce(grads)  # DDP's gradient sync: the ranks keep in step anyway
                if poll:
                    ft_train.get_preemption_info()
            per_step[label].append(1e3 * (time.perf_counter() - started) / steps)
            agreements = s.agreements if poll else agreements
            ft_train.collective.barrier()
    for label, figures in per_step.items():
        found[label] = {"ms_per_step_median": statistics.median(figures), "runs": figures}
    found["steps_with_poll"]["agreements"] = agreements
    found["poll_overhead_us_per_step"] = 1e3 * (
        found["steps_with_poll"]["ms_per_step_median"]
        - found["steps_without_poll"]["ms_per_step_median"]
    )
    session_module.install(None)
    out.put(found)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    from ft_train.worker.rank import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, args.calls, args.step_ms / 1e3, args.steps, out))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for result in sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"]):
        print(json.dumps(result))
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
