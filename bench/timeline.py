"""The timeline PNG: what each rank did around a failure, and during a cold start.

One panel per recovery figure (x = seconds from the kill) and one for the cold starts (x = seconds
from the flow call / fit()). Each lane is one rank of one system: a tick per completed step, a
triangle where the training function started, a dot where it restored a checkpoint, and the
measured interval shaded.
"""

from __future__ import annotations

from typing import Any

COLORS = {"ft-train": "tab:blue", "ray": "tab:orange"}


def _lanes(ax, runs: list[tuple[str, list[dict], float, float | None]], xlabel: str) -> None:
    """runs: (system, events, t0, measured seconds or None)."""
    y, ticks, labels = 0, [], []
    for system, events, t0, measured in runs:
        color = COLORS.get(system.split()[0], "gray")
        ranks = sorted({e["rank"] for e in events})
        top = y
        for rank in ranks:
            ev = [e for e in events if e["rank"] == rank]
            steps = [e["t"] - t0 for e in ev if e["event"] == "step"]
            ax.scatter(steps, [y] * len(steps), marker="|", s=60, color=color, linewidths=1)
            starts = [e["t"] - t0 for e in ev if e["event"] == "start"]
            ax.scatter(starts, [y] * len(starts), marker=">", s=30, color=color)
            rest = [e["t"] - t0 for e in ev if e["event"] == "restored"]
            ax.scatter(rest, [y] * len(rest), marker="o", s=25, facecolors="none", edgecolors=color)
            kills = [e["t"] - t0 for e in ev if e["event"] == "kill"]
            ax.scatter(kills, [y] * len(kills), marker="x", s=60, color="red", zorder=3)
            ticks.append(y)
            labels.append(f"{system} rank {rank}")
            y += 1
        if measured is not None:
            ax.fill_between([0.0, measured], top - 0.4, y - 0.6, color=color, alpha=0.15)
            ax.text(
                measured,
                (top + y - 1) / 2,
                f" {measured:.1f} s",
                va="center",
                fontsize=8,
                color=color,
            )
        y += 0.5
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.axvline(0, color="red", lw=0.8, ls="--")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)


def draw(figs: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for key, title in (
        ("recovery", "a rank's process is SIGKILLed (x: s from the kill)"),
        ("node_loss", "a worker node is lost (x: s from the kill)"),
    ):
        f = figs.get(key)
        if not f:
            continue
        runs = []
        for system in ("ft-train", "ray"):
            ev = f.get(system, {}).get("events") or []
            kills = [e["t"] for e in ev if e["event"] == "kill"]
            if kills:
                runs.append((system, ev, kills[0], f[system].get("s")))
        if runs:
            panels.append((title, runs, "seconds from the kill"))
    cold = figs.get("cold_start")
    if cold:
        runs = []
        for mode, label in (("fresh", "nothing running"), ("running", "server/cluster running")):
            for system in ("ft-train", "ray"):
                fig = cold.get(mode, {}).get(system, {})
                timed = [r for r in fig.get("runs", []) if "events" in r]
                if timed:  # the run whose figure is the median
                    r = min(timed, key=lambda x: abs(x["s"] - (fig.get("s") or 0)))
                    runs.append((f"{system} ({label})", r["events"], r["t_call"], r["s"]))
        if runs:
            panels.append(
                ("cold start (x: s from the flow call / fit())", runs, "seconds from the call")
            )
    if not panels:
        return
    heights = [
        max(2.0, 0.35 * sum(len({e["rank"] for e in r[1]}) + 0.5 for r in runs))
        for _, runs, _ in panels
    ]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(11, sum(heights) + 1.2 * len(panels)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (title, runs, xlabel) in zip(axes[:, 0], panels):
        _lanes(ax, runs, xlabel)
        ax.set_title(title, fontsize=10, loc="left")
    fig.suptitle(
        "ft-train vs Ray Train V2: | step done, > training function started, "
        "o checkpoint restored, x kill",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
