"""The labels a rank's checkpoints may not take: `report(checkpoint_dir_name=...)` names each
checkpoint once (Ray: "it must be unique across all checkpoints").

A label is refused on the rank, before anything is uploaded, when a committed checkpoint the run
keeps has it (the run state, read once at this attempt's first labelled checkpoint, with the
sealed index of a long run), or when this rank attached a checkpoint with it earlier in this
attempt. A round of an earlier attempt that was never committed leaves its label free: the
restart reports that round again, with the same label. The label of a checkpoint that
retention deleted in an earlier attempt is not remembered, and may be used again.

The storage directory never depends on the label alone (`checkpoint_manager.checkpoint_dir_name`
puts the report index and the attempt before it), so a label reused against this rule could
not mix two checkpoints' files; the rule keeps the names a user finds unambiguous.
"""

from __future__ import annotations

from ..errors import SessionError
from ..storage.checkpoint_manager import label_of
from ..storage.fs import Storage
from ..storage.run_state import RunStore


class Labels:
    def __init__(self, storage: Storage, name: str):
        self.storage, self.name = storage, name
        self.committed: set[str] | None = None  # read when first needed
        self.used: dict[str, int] = {}  # label -> the report index this attempt used it at

    def claim(self, label: str, report_index: int) -> None:
        """Take `label` for report `report_index`'s checkpoint, or raise SessionError."""
        if self.committed is None:
            store = RunStore(self.storage, self.name)
            state = store.load()
            entries = [] if state is None else store.all_checkpoints(state)
            self.committed = {lb for e in entries if (lb := label_of(e.dir_name)) is not None}
        if label in self.used:
            where = f"report {self.used[label]} of this attempt"
        elif label in self.committed:
            where = "a committed checkpoint of this run"
        else:
            self.used[label] = report_index
            return
        raise SessionError(
            f"report(checkpoint_dir_name={label!r}) at report {report_index}: {where} already "
            "has that name; give each checkpoint its own name (e.g. include the epoch or step: "
            "f'epoch_{epoch}'), or pass checkpoint_dir_name=None for ft-train's own"
        )
