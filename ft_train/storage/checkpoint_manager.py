"""The commit protocol for checkpoints, and retention. Driver side.

A report round with a checkpoint is committed in this order; each step is a crash point after
which the previous committed checkpoint is still the one a restore finds:

  1. every rank has uploaded its files into `{name}/{dir_name}/` (before it sent its report);
     `dir_name` carries the attempt, so a directory never mixes files from two attempts. Where
     several ranks attached a file of the same name, the lowest rank's is the checkpoint's
     (`controller.rounds`); its bytes are in place, or at the side path a rank wrote them to
     when another rank had created the name first (`storage.fs`): they are moved into place
     now, and the side paths deleted (`_into_place`);
  2. the manifest (files, sizes, sha256) is written last inside the directory: a single PUT;
  3. the run state now references the checkpoint (and no longer references any that
     retention drops): one atomic write. This is the commit point. When the head overflows
     (`num_to_keep=None` only), a sealed index chunk is written just before it (see `_seal`);
  4. only then are dropped checkpoints deleted. A crash here leaves orphan directories,
     never a run state that points at a deleted checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..config import CheckpointConfig
from .checkpoint import MANIFEST
from .fs import DUPLICATES, FileInfo, Storage
from .run_state import INDEX_CHUNK, CheckpointEntry, RunState, RunStore, now

# A checkpoint directory's name: group 1 is the report index, group 2 the label, if one was
# given (`report(checkpoint_dir_name=...)`; `report_config.LABEL` says what a label may hold).
# The attempt's id, hex, cannot hold a '-': the label starts after the first '-' that follows it.
CHECKPOINT_DIR = re.compile(
    r"^checkpoint_(\d{6,})-a\d+-[0-9a-f]+(?:-([A-Za-z0-9][A-Za-z0-9._=+,@-]*))?$"
)


def checkpoint_dir_name(
    report_index: int, attempt: int, attempt_id: str, label: str | None = None
) -> str:
    """The storage directory of round `report_index`'s checkpoint in `attempt`: never reused
    across attempts (storage invariant 3), whatever the label. A label (Ray's
    `checkpoint_dir_name`, checked by `report_config.checkpoint_label`) ends the name, so that
    the checkpoint's path ends with it: `checkpoint_000012-a0-1f2e3d4c-epoch_3`."""
    name = f"checkpoint_{report_index:06d}-a{attempt}-{attempt_id[:8]}"
    return name if label is None else f"{name}-{label}"


def label_of(dir_name: str) -> str | None:
    """The label a checkpoint directory's name ends with, or None (none given, or a name that
    is not a checkpoint directory's)."""
    m = CHECKPOINT_DIR.match(dir_name)
    return m.group(2) if m else None


def score(entry: CheckpointEntry, cfg: CheckpointConfig) -> float:
    value = entry.metrics.get(cfg.checkpoint_score_attribute or "")
    if not isinstance(value, (int, float)) or math.isnan(value):
        return -math.inf  # missing or NaN ranks worst
    return value if cfg.checkpoint_score_order == "max" else -value


def retained(entries: list[CheckpointEntry], latest: str, cfg: CheckpointConfig) -> list[str]:
    """Names of the checkpoints to keep: the best `num_to_keep`, and always the latest."""
    if cfg.num_to_keep is None:
        return [e.dir_name for e in entries]
    if cfg.checkpoint_score_attribute is None:
        ranked = sorted(entries, key=lambda e: e.report_index, reverse=True)
    else:
        ranked = sorted(entries, key=lambda e: (score(e, cfg), e.report_index), reverse=True)
    keep = {e.dir_name for e in ranked[: cfg.num_to_keep]} | {latest}
    return [e.dir_name for e in entries if e.dir_name in keep]


class CheckpointManager:
    def __init__(
        self,
        storage: Storage,
        store: RunStore,
        cfg: CheckpointConfig,
        index_chunk: int = INDEX_CHUNK,
    ):
        self.storage, self.store, self.cfg = storage, store, cfg
        self.index_chunk = index_chunk  # entries per sealed chunk; a test may lower it

    def commit(
        self,
        state: RunState,
        dir_name: str,
        report_index: int,
        metrics: dict[str, Any],
        files: dict[str, FileInfo],
        attempt: int,
    ) -> list[str]:
        """Commit one checkpoint (steps 2-4 above); return the names it deleted."""
        run = self.store.name
        files = self._into_place(f"{run}/{dir_name}", files)
        manifest = {
            "dir_name": dir_name,
            "report_index": report_index,
            "attempt": attempt,
            "metrics": metrics,
            "files": files,
            "committed_at": now().isoformat(),
        }
        # 2. the manifest, last of the checkpoint's own files
        self.store.write(f"{run}/{dir_name}/{MANIFEST}", json.dumps(manifest).encode())

        # 3. the commit point: the run state references the new checkpoint
        entry = CheckpointEntry(
            dir_name=dir_name, report_index=report_index, metrics=metrics, attempt=attempt
        )
        candidates = state.checkpoints + [entry]
        keep = set(retained(candidates, dir_name, self.cfg))
        dropped = [e.dir_name for e in candidates if e.dir_name not in keep]
        state.checkpoints = [e for e in candidates if e.dir_name in keep]
        self._seal(state)
        state.latest = dir_name
        state.report_index = report_index
        self.store.save(state)

        # 4. delete only what the saved state no longer references
        for name in dropped:
            self.storage.delete_dir(f"{run}/{name}")
        return dropped

    def _into_place(self, path: str, files: dict[str, FileInfo]) -> dict[str, FileInfo]:
        """Step 1's end: the winning bytes of every name in place; the manifest's entries.

        `files` is the round's (`controller.rounds.Round.files`): an entry with `"at"` has its
        bytes at that side path, one with `"ranks"` was attached by several ranks (some of
        whose bytes may be at side paths). Nothing to do, and no storage call, where neither
        is there: the common case.

        Crash ordering: each move comes before the side paths' delete, and both before the
        manifest. A crash in between leaves a directory without a manifest, which no restore
        reads and the orphan sweep removes whole (side paths included); the previous committed
        checkpoint stays the latest."""
        moved = [rel for rel, info in files.items() if "at" in info]
        if not moved and not any("ranks" in info for info in files.values()):
            return files
        for rel in moved:
            self.storage.move_file(f"{path}/{files[rel]['at']}", f"{path}/{rel}")
        self.storage.delete_dir(f"{path}/{DUPLICATES}")
        return {rel: {"size": i["size"], "sha256": i["sha256"]} for rel, i in files.items()}

    def _seal(self, state: RunState) -> None:
        """While the head holds more than `index_chunk` entries, move its oldest `index_chunk`
        into the next sealed chunk (more than one only for a head written by schema 1). Only
        entries retention can never drop may be sealed: with `num_to_keep=None` that is all of
        them; with `num_to_keep` set the head stays bounded by it, so nothing is sealed. (A run
        that sealed and is resumed with `num_to_keep` set keeps its sealed checkpoints:
        retention only ranks the head's.)

        Crash ordering: chunks are written before the head that counts them. A crash in between
        leaves the previous head, which does not count them; the next commit seals the same
        entries under the same chunk names, overwriting them."""
        if self.cfg.num_to_keep is not None:
            return
        while len(state.checkpoints) > self.index_chunk:
            self.store.write_chunk(state.sealed_chunks, state.checkpoints[: self.index_chunk])
            state.checkpoints = state.checkpoints[self.index_chunk :]
            state.sealed_chunks += 1

    def collect_orphans(self, state: RunState, read_index: bool = True) -> list[str]:
        """Delete checkpoint directories the run state does not reference (crash leftovers);
        return their names. One listing of the run's directory.

        A sealed checkpoint is referenced, never an orphan. Commits only go forward in report
        index (a fall-back drops head entries, it never revives sealed ones), so every sealed
        entry is older than the head's oldest: an unreferenced directory at or past that index
        is an orphan without reading the sealed index. An older one may be sealed: with
        `read_index` the sealed chunks are read to tell (one read each); without (a driver's
        start, which must stay O(1) reads: invariant 5) it is left for a later full sweep."""
        self.store.fence()  # a driver that lost the run must not delete the new one's uploads
        found = {
            m.group(0): int(m.group(1))
            for n in self.storage.list_dir(self.store.name)
            if (m := CHECKPOINT_DIR.match(n))
        }
        referenced = {e.dir_name for e in state.checkpoints}
        if state.sealed_chunks:
            oldest = min((e.report_index for e in state.checkpoints), default=math.inf)
            if read_index:
                referenced |= {e.dir_name for e in self.store.all_checkpoints(state)}
            else:
                referenced |= {n for n, index in found.items() if index < oldest}
        orphans = [n for n in found if n not in referenced]
        # Crash ordering: the saved state already does not reference these (they were never in
        # it, or retention saved it without them first); a crash midway leaves some for later.
        for name in orphans:
            self.storage.delete_dir(f"{self.store.name}/{name}")
        return orphans

    def drop_damaged(self, state: RunState) -> CheckpointEntry | None:
        """The latest checkpoint is damaged (its files do not match its manifest): drop it
        from the run, so that the next group restores from the newest checkpoint before it;
        that one, or None (nothing changed) when the head keeps no earlier one.

        Crash ordering: only the run state in memory changes; the caller saves it with the
        failure that says why. A crash before that leaves the damaged checkpoint referenced,
        and the next restore finds it damaged again and drops it then. Its directory, once no
        saved state references it, is left to the orphan sweep (`collect_orphans`)."""
        earlier = [c for c in state.checkpoints if c.dir_name != state.latest]
        if not earlier:
            return None
        previous = max(earlier, key=lambda c: c.report_index)
        state.checkpoints = earlier
        state.latest, state.report_index = previous.dir_name, previous.report_index
        return previous

    def latest_uri(self, state: RunState) -> str | None:
        return self.storage.uri(f"{self.store.name}/{state.latest}") if state.latest else None
