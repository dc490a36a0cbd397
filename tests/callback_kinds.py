"""User callbacks for the tests (`RunConfig.callbacks`): importable by path from the driver, in
the test's process or a driver process of its own."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import ft_train


class Recorder(ft_train.UserCallback):
    """Records every hook call it gets, in order, with the time it got it; with `path`, also as
    JSON lines there. `secrets`: credentials it is given (the tests plant them); it writes only
    their hashes, which show they arrived."""

    def __init__(self, path: str | None = None, **secrets: str):
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.path = path
        self.sha = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in secrets.items()}
        self.ended = threading.Event()

    def _record(self, hook: str, **about: Any) -> None:
        about["at"] = time.monotonic()
        self.calls.append((hook, about))
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"hook": hook, "sha": self.sha, **about}) + "\n")

    def after_report(self, run_context, metrics, checkpoint, report_index=0):
        self._record(
            "after_report",
            index=report_index,
            ranks=len(metrics),
            checkpoint=checkpoint.path if checkpoint else None,
            path=run_context.path,
        )

    def after_exception(self, run_context, worker_exceptions):
        self._record(
            "after_exception",
            errors={r: f"{type(e).__name__}: {e}" for r, e in worker_exceptions.items()},
        )

    def after_checkpoint(self, run_context, checkpoint, report_index, metrics):
        self._record("after_checkpoint", index=report_index, checkpoint=checkpoint.path)

    def after_failure(self, run_context, failure, failures_left):
        self._record("after_failure", kind=failure.kind, left=failures_left)

    def after_run_end(self, run_context, status, error):
        self._record("after_run_end", status=status, error=error)
        self.ended.set()

    def hooks(self, name: str) -> list[dict[str, Any]]:
        return [about for hook, about in self.calls if hook == name]


class RayStyle(ft_train.UserCallback):
    """Ray's signatures exactly (no report_index): ft-train must call them as Ray does."""

    def __init__(self):
        self.reports: list[int] = []
        self.exceptions: list[dict[int, Exception]] = []

    def after_report(self, run_context, metrics, checkpoint):
        self.reports.append(len(metrics))

    def after_exception(self, run_context, worker_exceptions):
        self.exceptions.append(worker_exceptions)


class Slow(ft_train.UserCallback):
    """Blocks 5 s in every call, as a tracker that cannot be reached would (in a wait that ends
    when the test is done with it, so that nothing outlives the test)."""

    def __init__(self, seconds: float = 5.0):
        self.seconds, self.calls = seconds, 0

    def _block(self) -> None:
        self.calls += 1
        time.sleep(self.seconds)  # the callback's own slowness: what is measured, not a sync

    def after_report(self, run_context, metrics, checkpoint):
        self._block()

    def after_exception(self, run_context, worker_exceptions):
        self._block()

    def after_checkpoint(self, run_context, checkpoint, report_index, metrics):
        self._block()

    def after_failure(self, run_context, failure, failures_left):
        self._block()

    def after_run_end(self, run_context, status, error):
        self._block()


class Raising(ft_train.UserCallback):
    """Raises in every hook."""

    def __init__(self, token: str | None = None):
        self.token = token

    def _raise(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the callback's own bug")

    after_report = after_exception = after_checkpoint = after_failure = after_run_end = _raise


class NotACallback:
    """A class that is not a UserCallback: naming it is refused."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
