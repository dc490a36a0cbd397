"""How ft-train words counts in what it prints and logs: progress in reports (DESIGN.md's
vocabulary: a report is one `report()` round, counted from 1), with plurals that agree."""

from __future__ import annotations


def plural(n: int, noun: str) -> str:
    """`0 reports`, `1 report`, `2 reports` (nouns whose plural takes an `s`)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def after_report(n: int | None) -> str:
    """Where something happened, in reports: `after report 7`, or `before the first report`
    (a rank that failed with `n` reports made failed after its n-th)."""
    if n is None:
        return "at an unknown report"
    return f"after report {n}" if n > 0 else "before the first report"
