"""The run's metrics as a picture for the Prefect UI: one small line chart per metric (each on
its own scale), an SVG drawn here from the bounded metric history (no plotting library: the
flow process installs none), carried as a `data:image/svg+xml` URL.

What renders, checked with headless Chromium against `prefect server start` (Prefect 3.9.1,
`tests/ui_screenshot.py`): an image artifact with a `data:image/...` URL shows in both UIs (v1
and the default v2), as does `![...](data:image/...)` in a markdown artifact (v2's markdown
sanitizer allows `data:` for an `<img>` only); SVG inline in markdown is dropped by both.
"""

from __future__ import annotations

import base64
import math
from html import escape

from ft_train.storage.metric_history import MetricHistory

# Reported to place a point, not to be plotted: the x axis and the progress' total, where a
# restart resumed from (the demo's `resumed_from`: a dashed line marks it already), and clock
# times (Ray's auto-filled ones among them), whose epoch seconds would flatten any chart.
NOT_PLOTTED = frozenset(
    {"step", "time", "total_steps", "epoch", "resumed_from", "timestamp", "time_total_s"}
    | {"training_iteration", "iterations_since_restore"}
)
MAX_CHARTS = 6
COLUMNS = 2
W, H = 440, 170  # one chart
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 30, 30
COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"]


def charted(history: MetricHistory) -> list[str]:
    """The metrics drawn: the numeric ones reported, first seen first, up to MAX_CHARTS; not
    what places a point (`NOT_PLOTTED`), nor a clock time (a name ending in `_timestamp` or
    `_at`; a duration such as `step_time` is a metric)."""
    return [s for s in history.series if is_metric(s)][:MAX_CHARTS]


def is_metric(name: str) -> bool:
    return name not in NOT_PLOTTED and not name.endswith(("_timestamp", "_at"))


def svg(history: MetricHistory) -> str:
    names = charted(history)
    rows = max(1, math.ceil(len(names) / COLUMNS))
    width, height = W * min(COLUMNS, max(1, len(names))), H * rows + 22
    steps = [int(p["step"] or 0) for p in history.points]
    x0, x1 = (min(steps), max(steps)) if steps else (0, 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    if not names:
        parts.append('<text x="12" y="40" fill="#444">no numeric metrics reported yet</text>')
    for i, name in enumerate(names):
        ox, oy = W * (i % COLUMNS), H * (i // COLUMNS)
        parts += _chart(history, name, ox, oy, (x0, x1), COLORS[i % len(COLORS)])
    note = f"step {x0} to {x1}; {len(history.points)} points"
    if history.stride > 1:
        note += f" (every {history.stride}th step, and the newest)"
    if history.restarts:
        note += "; dashed: a restart from a checkpoint"
    parts.append(f'<text x="8" y="{height - 7}" fill="#555">{escape(note)}</text>')
    return "\n".join(parts + ["</svg>"])


def data_url(history: MetricHistory) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg(history).encode()).decode()


def _chart(
    history: MetricHistory, name: str, ox: int, oy: int, xs: tuple[int, int], color: str
) -> list[str]:
    pts = [(int(p["step"] or 0), p[name]) for p in history.points if p.get(name) is not None]
    values = [float(v) for _, v in pts if v is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    x0, x1 = xs
    span = max(1, x1 - x0)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def at(step: int, value: float) -> str:
        x = ox + LEFT + pw * (step - x0) / span
        y = oy + TOP + ph * (1 - (value - lo) / (hi - lo))
        return f"{x:.1f},{y:.1f}"

    left, top, bottom = ox + LEFT, oy + TOP, oy + TOP + ph
    last = f"{values[-1]:.4g}" if values else "-"
    out = [
        f'<text x="{left}" y="{oy + 18}" font-size="13" font-weight="bold" fill="#111">'
        f"{escape(name)}</text>",
        f'<text x="{ox + W - RIGHT}" y="{oy + 18}" text-anchor="end" fill="#333">'
        f"last {last}</text>",
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#f8fafc" stroke="#cbd5e1"/>',
        f'<text x="{left - 4}" y="{top + 9}" text-anchor="end" fill="#555">{hi:.4g}</text>',
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end" fill="#555">{lo:.4g}</text>',
        f'<text x="{left}" y="{bottom + 14}" fill="#555">{x0}</text>',
        f'<text x="{left + pw}" y="{bottom + 14}" text-anchor="end" fill="#555">{x1}</text>',
    ]
    for step in history.restarts:
        if x0 <= step <= x1:
            x = ox + LEFT + pw * (step - x0) / span
            out.append(
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#f97316" '
                'stroke-dasharray="4 3"/>'
            )
    coords = " ".join(at(s, float(v)) for s, v in pts if v is not None)
    if len(values) == 1:
        cx, cy = coords.split(",")
        out.append(f'<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>')
    elif values:
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.6"/>')
    return out
