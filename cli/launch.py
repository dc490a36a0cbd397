"""Training as the Prefect flow from the command line, shared by `ft-train run` and `ft-train
demo`: whether the run may start (its storage, another driver's lease), the flow's call on a
quiet console under a progress bar, and what is printed at the end: the summary with what each
recovery cost, or the error without a traceback.

`flows.train` (and with it Prefect) is imported when a command trains, after the environment
defaults are set.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ft_train.config import RunConfig, name_of
from ft_train.driver import resume
from ft_train.driver.lease import live_holder
from ft_train.errors import ConfigError, FtTrainError, RunLockedError, StorageError
from ft_train.result import TrainResult
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState

from .common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, load_state
from .output import headline, print_recoveries, print_summary, say
from .progress import StoredProgress


class QuietConsole(logging.Filter):
    """What the command's console leaves out of the flow's logs; Prefect's API log handler, which
    sees each record before the console does, still stores all of it.

    - The traceback of ft-train's own errors. A group failure that Prefect retries, a spent
      failure budget, or bad input is an FtTrainError whose message says what happened; the
      rank's own traceback is logged by the controller, and the summary lists every failure.
      Their traceback would show only ft-train's and Prefect's internals. Any other exception
      keeps its traceback.
    - "Finished in state Completed()" of each task run: one per checkpoint, it would double the
      progress lines. Failed and crashed states, and the flow run's end, are kept.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FtTrainError):
            record.exc_info, record.exc_text = None, None
        if getattr(record, "task_run_id", None) is not None and isinstance(record.msg, str):
            return not record.msg.startswith("Finished in state Completed(")
        return True


def quiet_console() -> None:
    # Prefect's console handler sits on the root logger; flow and task run records reach it last.
    for handler in logging.getLogger().handlers:
        handler.addFilter(QuietConsole())


def prefect_reachable() -> bool:
    """Does the Prefect API that the flow will use answer (`flows.api`)? Prints why not, in one
    line. Asked before the command announces or starts anything."""
    # Before Prefect is imported: an offline machine must not print telemetry errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.api import PrefectApiUnreachable, check_reachable

    try:
        check_reachable()
    except PrefectApiUnreachable as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return False
    return True


def stored_before(config: RunConfig) -> tuple[bool, RunState | None]:
    """(whether the command may train, the run as stored before it). Prints why it may not: the
    storage cannot be read, or another driver holds the run (said now, not after Prefect's start)."""
    try:
        before = load_state(config)
        storage = Storage(config.storage_path, config.storage_options)
        lease = live_holder(storage, name_of(config)) if before is not None else None
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return False, None
    if lease is not None:
        print(
            f"error: run {config.name!r} is being trained by another driver ({lease.describe()}); "
            "wait for it to end or stop it, or use another --name",
            file=sys.stderr,
        )
        return False, None
    return True, before


def refused(params: dict[str, Any], before: RunState | None) -> bool:
    """Does the run's resume policy refuse these parameters (`ft_train.driver.resume`)? Asked
    here too, so that the refusal comes at once, not after Prefect's start; prints it."""
    config: RunConfig = params["run_config"]
    wanted = resume.wanted(
        params["train_loop"],
        params["train_loop_config"],
        params["scaling_config"],
        config.checkpoint_config,
    )
    where = Storage(config.storage_path, config.storage_options).uri(name_of(config))
    try:
        resume.check(config, before, wanted, where, lambda msg: None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if "allow_train_loop_change" in str(e):
            say("(on the command line: --allow-train-loop-change)")
        return True
    return False


def train_and_show(
    params: dict[str, Any], before: RunState | None, total: int | None = None
) -> tuple[int, TrainResult | None]:
    """Train as the flow with `params`; print the summary (or the error) at the end. The exit
    code, and the result if the flow returned one. `total`: the run's steps, where known."""
    config: RunConfig = params["run_config"]
    # Before Prefect is imported: an offline machine must not print telemetry errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.train import train  # imports Prefect and sets up its logging

    quiet_console()
    try:
        with StoredProgress(config, total):
            result = train(**params)
    except KeyboardInterrupt:
        say(f"\ninterrupted; run the same command again to resume {config.name!r}")
        return EXIT_INTERRUPTED, None
    except FtTrainError as e:
        return report_failure(config, e), None
    after = _read_after(config)
    if before is not None and before.status == "finished" and not _trained(before, after):
        say(f"\nRun {config.name!r} had already finished: nothing was trained. The stored run:")
    else:
        say(f"\nRun {config.name!r} {result.status}.")
    print_summary(result)
    if after is not None:
        print_recoveries(after)
    return (EXIT_OK if result.status == "finished" else EXIT_FAILED), result


def _read_after(config: RunConfig) -> RunState | None:
    try:
        return load_state(config)
    except StorageError as e:  # the summary came from the flow; only the recoveries are missing
        print(f"(the stored run cannot be read: {e})", file=sys.stderr)
        return None


def _trained(before: RunState, after: RunState | None) -> bool:
    """Did this command's driver train the run? Only a driver that trains counts itself."""
    return after is not None and after.driver_runs > before.driver_runs


def report_failure(config: RunConfig, error: FtTrainError) -> int:
    """The flow raised one of ft-train's own errors: show the stored run (if any) and the error,
    without a traceback (the error says what to change; a rank's traceback was logged above)."""
    try:
        state = load_state(config)
    except StorageError as read_error:  # the run's own error, printed below, matters more
        print(f"(the stored run cannot be read: {read_error})", file=sys.stderr)
        state = None
    if state is None or isinstance(error, (ConfigError, RunLockedError)):  # refused: it alone
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        if "allow_train_loop_change" in str(error):
            say("(on the command line: --allow-train-loop-change)")
        return EXIT_FAILED
    say(f"\nRun {config.name!r} {state.status}.")
    storage = Storage(config.storage_path, config.storage_options)
    print_summary(TrainResult.from_state(storage, state, config.checkpoint_config))
    print_recoveries(state)
    # The summary lists the failures: the error's first line is enough here.
    print(f"error: {type(error).__name__}: {headline(error)}", file=sys.stderr, flush=True)
    if state.status == "failed":
        say(
            "Run the same command again to resume it, from its latest checkpoint if any, with a "
            "fresh failure budget; or raise --max-failures."
        )
    return EXIT_FAILED
