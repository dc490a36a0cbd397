"""A run as a person reads it: the summary that `ft-train demo` and `ft-train status` print,
and the one-line messages between them."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from ft_train.result import TrainResult
from ft_train.storage.run_state import AttemptRecord, FailureRecord, RunState
from ft_train.wording import after_report, plural


def say(text: str) -> None:
    print(text, flush=True)


def fmt_metrics(metrics: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return "  ".join(f"{k}={fmt(v)}" for k, v in metrics.items())


def headline(error: BaseException) -> str:
    """An error's first line. A TrainingFailedError goes on to list the failures, which the
    summary shows already."""
    return str(error).splitlines()[0].removesuffix(" Failures:")


def print_summary(result: TrainResult, out: TextIO = sys.stdout) -> None:
    """A run, as a person reads it: where it lives, how it ended, what it kept, what failed."""
    kept = len(result.best_checkpoints)
    w = lambda label, text: print(f"  {label:<12} {text}", file=out)  # noqa: E731
    w("path", result.path)
    w("status", result.status)
    w(
        "checkpoints",
        f"{kept} kept, latest {result.checkpoint.path}" if result.checkpoint else "none committed",
    )
    w("failures", str(len(result.failures)) if result.failures else "none")
    for f in result.failures:
        where = "".join(
            (
                f" on rank {f.rank}" if f.rank is not None else "",
                "" if f.step is None else f" {after_report(f.step)}",
            )
        )
        note = "" if f.charged else ", not charged to max_failures"
        print(f"    - {f.kind}{where}: {f.error} (attempt {f.attempt}{note})", file=out)
    w("metrics", fmt_metrics(result.last_metrics) if result.last_metrics else "none reported")
    if result.error is not None:
        w("error", headline(result.error))
    out.flush()


@dataclass
class Recovery:
    """What one restart cost, in reports (DESIGN.md's vocabulary) and wall time.

    `reports_lost`: the run's reports before the failure less the round the next attempt
    resumed from (reports that were made again). `gap_s`: from the last progress before the
    failure (the newest round's arrival at the driver; for a driver crash, the ranks' journals)
    to the next attempt's first report; where a record lacks one end (an older run, an attempt
    that has not reported yet), from the failure's record or to the attempt's start, as `gap`
    says."""

    failure: FailureRecord
    attempt: AttemptRecord
    reports_before: int | None
    reports_lost: int | None
    gap_s: float
    gap: str  # what the gap is measured between

    def text(self) -> str:
        f, nxt = self.failure, self.attempt
        where = f" on rank {f.rank}" if f.rank is not None else ""
        at = "" if self.reports_before is None else f" {after_report(self.reports_before)}"
        frm = f"report {nxt.start_report_index}" if nxt.start_report_index else "scratch"
        if nxt.restored_snapshot is not None:
            frm += " (in memory)"
        lost = "" if self.reports_lost is None else f"{plural(self.reports_lost, 'report')} lost, "
        return (
            f"{f.kind}{where}{at} -> {plural(nxt.world_size, 'rank')} resumed from {frm}: "
            f"{lost}{self.gap_s:.1f} s {self.gap}"
        )

    def doc(self) -> dict[str, Any]:
        """For `status --json`."""
        return {
            "kind": self.failure.kind,
            "rank": self.failure.rank,
            "attempt": self.attempt.attempt,
            "reports_before": self.reports_before,
            "resumed_from_report": self.attempt.start_report_index,
            "reports_lost": self.reports_lost,
            "gap_s": round(self.gap_s, 3),
            "gap": self.gap,
            "text": self.text(),
        }


def recovery_costs(state: RunState) -> list[Recovery]:
    """What each restart cost, from the run state: each failure that a later attempt resumed
    from (not one that ended the run, nor one whose next driver has not started yet)."""
    out = []
    starts = {a.attempt: a for a in state.attempts}
    for f in state.failures:
        nxt = starts.get(f.attempt + 1)
        if nxt is None:
            continue
        before = f.reports if f.reports is not None else f.step  # older records: the rank's
        lost = None if before is None else max(0, before - nxt.start_report_index)
        since, since_what = (
            (f.last_report_at, "from the last progress")
            if f.last_report_at is not None
            else (f.time, "from the failure")
        )
        until, until_what = (
            (nxt.first_report_at, "the first resumed report")
            if nxt.first_report_at is not None
            else (nxt.started_at, "the restart")
        )
        gap = max(0.0, (until - since).total_seconds())
        out.append(Recovery(f, nxt, before, lost, gap, f"{since_what} to {until_what}"))
    return out


def recoveries(state: RunState) -> list[str]:
    """What each restart cost, one line each (`recovery_costs`)."""
    return [r.text() for r in recovery_costs(state)]


def print_recoveries(state: RunState, out: TextIO = sys.stdout) -> None:
    for i, line in enumerate(recoveries(state)):
        print(f"  {'recovery' if i == 0 else '':<12} {line}", file=out)
    out.flush()
