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
    goodput.rebase(out, 12.0, [11.0, 13.0])  # against the fault-free runs before and after it
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
