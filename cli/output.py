"""A run as a person reads it: the summary that `ft-train demo` and `ft-train status` print,
and the one-line messages between them."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ft_train.result import TrainResult
from ft_train.storage.run_state import RunState


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
                f" at step {f.step}" if f.step is not None else "",
            )
        )
        note = "" if f.charged else ", not charged to max_failures"
        print(f"    - {f.kind}{where}: {f.error} (attempt {f.attempt}{note})", file=out)
    w("metrics", fmt_metrics(result.last_metrics) if result.last_metrics else "none reported")
    if result.error is not None:
        w("error", headline(result.error))
    out.flush()


def recoveries(state: RunState) -> list[str]:
    """What each restart cost, from the run state: the failure, the checkpoint the next attempt
    started from, the steps trained again, and the time from the failure to that start."""
    out = []
    starts = {a.attempt: a for a in state.attempts}
    for f in state.failures:
        nxt = starts.get(f.attempt + 1)
        if nxt is None:
            continue  # the run ended there (a spent budget), or its next driver has not started
        where = f" on rank {f.rank}" if f.rank is not None else ""
        at = f" at step {f.step}" if f.step is not None else ""
        frm = f"checkpoint at step {nxt.start_report_index}" if nxt.restored_from else "scratch"
        lost = "" if f.step is None else f"{f.step - nxt.start_report_index} steps trained again, "
        took = max(0.0, (nxt.started_at - f.time).total_seconds())
        out.append(
            f"{f.kind}{where}{at} -> {nxt.world_size} ranks restarted from {frm}: "
            f"{lost}{took:.1f} s from the failure to the restart"
        )
    return out


def print_recoveries(state: RunState, out: TextIO = sys.stdout) -> None:
    for i, line in enumerate(recoveries(state)):
        print(f"  {'recovery' if i == 0 else '':<12} {line}", file=out)
    out.flush()
