"""The goodput benchmark's figures, from an event log (its harness, which runs processes, is in
`tests/test_goodput_bench.py`)."""

from __future__ import annotations

import pytest

from bench import goodput


def _steps(ev: list[dict], rank: int, steps: range, t0: float, dt: float) -> float:
    for i, s in enumerate(steps):
        ev.append({"rank": rank, "event": "step", "step": s, "t": t0 + i * dt})
    return t0 + (len(steps) - 1) * dt


def test_the_figures_of_an_event_log_with_a_restart():
    # Two ranks, 10 steps/s: steps 1-51 from t=1.0, a fault at t=6.02, a restart at t=8.0 that
    # restores step 45; rank 1 completes its first step after it last, at t=8.65.
    ev: list[dict] = []
    for rank in (0, 1):
        ev.append({"rank": rank, "event": "start", "t": 0.5, "pid": 10 + rank})
        _steps(ev, rank, range(1, 52), 1.0 + rank * 0.01, 0.1)
        ev.append({"rank": rank, "event": "start", "t": 8.0, "pid": 20 + rank})
        ev.append({"rank": rank, "event": "restored", "t": 8.2, "step": 45})
        _steps(ev, rank, range(46, 101), 8.6 + rank * 0.05, 0.1)
    figures = goodput.fault_figures(ev, 6.02)
    assert figures["reached"] == 51 and figures["resumed_from"] == 45
    assert figures["lost_steps"] == 6
    assert figures["recovery_s"] == pytest.approx(8.65 - 6.02)

    prog = goodput.progress(ev)
    # step 1 on both ranks at 1.01; step 100 on both at 8.65 + 5.4
    assert prog["final_step"] == 100
    assert prog["wall_s"] == pytest.approx(8.65 + 5.4 - 1.01)
    assert prog["steps_per_s"] == pytest.approx(99 / (8.65 + 5.4 - 1.01))

    out = goodput.summarise(
        {"events": ev, "faults": [{"kind": "kill", "rank": 1, "t": 6.02}]}, 10.0, {}
    )
    assert out["goodput"] == pytest.approx(prog["steps_per_s"] / 10.0)
    # against the fault-free runs before and after it: their steps/s, their samples/s (every
    # step here trained by both ranks, a sample each)
    goodput.rebase(out, [11.0, 13.0], [22.0, 26.0])
    assert out["samples_per_s"] == pytest.approx(2 * prog["steps_per_s"])
    assert out["goodput"] == pytest.approx(prog["steps_per_s"] / 12.0)
    assert "12.00 (11.00, 13.00)" == goodput._fault_free(out)
    assert out["faults"][0]["t_s"] == pytest.approx(6.02 - 1.01, abs=0.01)
    assert out["lost_steps"]["max"] == 6 and out["unrecovered"] == 0
    # the series drops back at the restart: its last point before it and its first after it
    assert [51, 46] == [p[1] for p in out["series"] if p[1] in (51, 46)]

    # a fault after which nothing restarted: not recovered, and left out of the figures
    late = goodput.summarise(
        {"events": ev, "faults": [{"kind": "node", "rank": 0, "t": 99.0}]}, 10.0, {}
    )
    assert late["unrecovered"] == 1 and late["lost_steps"] is None


def test_the_figures_of_a_system_that_goes_on_with_the_replicas_it_has():
    # torchft: rank 1 dies at t=5.05 during step 41 (rank 0 throws that step away), rank 0
    # trains steps 41-60 alone, rank 1 is back for step 61 at t=9.0; 10 steps/s throughout.
    ev: list[dict] = []
    for rank in (0, 1):
        ev.append({"rank": rank, "event": "start", "t": 0.5, "pid": 10 + rank})
        _steps(ev, rank, range(1, 41), 1.0, 0.1)
    ev.append({"rank": 0, "event": "discard", "step": 41, "t": 5.1})
    for i, s in enumerate(range(41, 61)):
        ev.append({"rank": 0, "event": "step", "step": s, "n": 1, "t": 7.0 + i * 0.1})
    ev.append({"rank": 1, "event": "start", "t": 6.0, "pid": 21})
    for rank in (0, 1):
        for i, s in enumerate(range(61, 101)):
            ev.append({"rank": rank, "event": "step", "step": s, "n": 2, "t": 9.0 + i * 0.1})

    figures = goodput.partial_fault_figures(ev, 5.05, 1)
    assert figures["recovery_s"] == pytest.approx(9.0 - 5.05)
    assert figures["reached"] == 40 and figures["resumed_from"] == 40
    assert figures["lost_steps"] == 1  # the discarded step; the group never went back
    assert figures["degraded_steps"] == 20
    assert goodput.partial_fault_figures(ev, 20.0, 1) == {"recovered": False}

    prog = goodput.progress(ev, batch=64, partial=True)
    assert prog["final_step"] == 100
    wall = 9.0 + 3.9 - 1.0
    assert prog["wall_s"] == pytest.approx(wall)
    # steps 2-40 and 61-100 by two replicas, 41-60 by one: 64 samples a replica a step
    assert prog["samples_per_s"] == pytest.approx((39 * 2 + 20 + 40 * 2) * 64 / wall)

    out = goodput.summarise(
        {"events": ev, "faults": [{"kind": "kill", "rank": 1, "t": 5.05}]}, None, {}, 64, True
    )
    goodput.against_ddp(out, [1000.0, 1200.0])
    assert out["goodput_vs_ddp"] == pytest.approx(prog["samples_per_s"] / 1100.0)
    assert out["degraded_steps"]["max"] == 20
    # the series is the group's: steps only go up, whichever rank completed them
    steps = [p[1] for p in out["series"]]
    assert steps == sorted(steps) and steps[-1] == 100


def test_ray_s_interval_is_the_best_of_its_sweep():
    sweep = [
        {"interval_s": 5.0, "checkpoint_every": 50, "goodput": 0.58},
        {"interval_s": 15.0, "checkpoint_every": 150, "goodput": 0.61},
        {"interval_s": 60.0, "checkpoint_every": 600, "goodput": 0.12},
    ]
    assert goodput.choose_interval(sweep)["interval_s"] == 15.0
    assert "every 15 s (150 steps): 0.610  <- used" in goodput.sweep_table(sweep, sweep[1])
    # equal goodput: the longer interval (fewer checkpoints); a failed run is passed over
    tie = [{"interval_s": 5.0, "goodput": 0.6}, {"interval_s": 15.0, "goodput": 0.6}]
    assert goodput.choose_interval(tie + [{"interval_s": 1.0, "goodput": None}]) is tie[1]
    assert goodput.choose_interval([{"interval_s": 5.0, "goodput": None}]) is None
