"""The progress bar of `ft-train run` and `ft-train demo`: rich's, fed by the run's stored state.

The flow runs in this process but reports nothing to it: the bar reads what a rerun would read,
the run state's head (one small read), at a steady pace on a thread, and moves as the run state
does: at each committed checkpoint, each restart and the end. It counts reports (DESIGN.md's
vocabulary: `RunState.reports`), the number `ft-train list` and `status --json` show. It draws
on the console of Prefect's log handler, so that the flow's log lines print above the bar
instead of through it. Not a terminal (a pipe, a test): one line at the end.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from rich.console import Console
from rich.default_styles import DEFAULT_STYLES
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.theme import Theme

from ft_train.config import RunConfig, name_of
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import RunState, RunStore
from ft_train.wording import plural

POLL_S = 1.0  # a local read costs microseconds, an S3 one a round trip: once a second for both
# The bar's own styles: Prefect's console has a theme of its own, without rich's defaults.
BAR_THEME = Theme(
    {k: v for k, v in DEFAULT_STYLES.items() if k.startswith(("bar.", "progress."))},
    inherit=False,
)


def log_console() -> Console:
    """The console Prefect's log handler prints on (stderr), or a new one on stderr."""
    for handler in logging.getLogger().handlers:
        console = getattr(handler, "console", None)
        if isinstance(console, Console):
            return console
    return Console(stderr=True)


class StoredProgress:
    """`with StoredProgress(config, total):` shows run `config.name`'s reports, out of `total`
    if known, its latest checkpoint and failures, while the block runs."""

    def __init__(self, config: RunConfig, total: int | None) -> None:
        self.store = RunStore(Storage(config.storage_path, config.storage_options), name_of(config))
        console = log_console()
        if not console.is_terminal:
            # In a log (CI, a file) the bar is drawn once, at the end, and nothing redraws it:
            # the whole line, not one cut at the 80 columns rich assumes without a terminal.
            console = Console(stderr=True, width=max(console.width, 160))
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reports  {task.fields[note]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task(f"training {config.name}", total=total, note="")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="ft-train-progress", daemon=True)

    def __enter__(self) -> StoredProgress:
        self.progress.console.push_theme(BAR_THEME)  # on top of Prefect's: its styles stay
        self.progress.start()
        self.thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop.set()
        self.thread.join()
        self._update()  # the run's last word, then the bar's last line
        self.progress.stop()
        self.progress.console.pop_theme()

    def _poll(self) -> None:
        while not self.stop.wait(POLL_S):
            self._update()

    def _update(self) -> None:
        try:
            state = self.store.load()
        except Exception:  # a read that fails shows nothing new; the flow reports the storage's
            return  # errors itself
        if state is None:
            return
        self.progress.update(self.task, completed=state.reports, note=_note(state))
        if state.status == "finished" and self.progress.tasks[0].total is None:
            self.progress.update(self.task, total=state.reports)  # now it is known


def _note(state: RunState) -> str:
    parts = [f"checkpoint at report {state.report_index}"] if state.latest else []
    if state.failures:
        parts.append(plural(len(state.failures), "failure"))
    return ", ".join(parts)
