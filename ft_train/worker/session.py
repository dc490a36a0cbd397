"""The worker-side API: `get_context()`, `get_checkpoint()`, `report()`.

A rank runs the user's training function inside a `Session`, installed for the duration of the
call. `report()` sends one small message to the driver and returns: it never waits for the
driver. With a checkpoint attached, the checkpoint's files go into a directory named after the
report index and the attempt: uploaded before the message is sent (`checkpoint_upload_mode=
"sync"`, the default), or snapshotted and uploaded in the background, the message following the
upload (`"async"`, see `ft_train.worker.uploads`).

report() also agrees with the other ranks on what they must all learn at the same report (a
worker's preemption notice, the driver's request to stop, a rank that returned early). That
agreement is an all-reduce over a small gloo group, started in the background at report k and
read at report k+1, so a report() does not wait for the slowest rank: what the ranks agree on at
report k+1 is what they knew when they called their k-th report(). With reports closer together
than `FailureConfig.agreement_interval_s` (0.25 s), the ranks start one only every few reports
(at most `knobs.AGREE_EVERY_MAX`), the same ones on every rank.

Guarantee: once `report()` has returned on every rank for round k, round k's checkpoint is
committed even if a rank dies the next instant; with `checkpoint_upload_mode="async"`, once its
uploads are stored. Only a driver death (or the loss of a journal's node) may lose it. report()
journals what the commit needs before it returns (`_journal`, `_returning`; `ft_train.worker.journal`).

Contract (what the driver relies on):
- every rank MUST call `report()` the same number of times; round k is rank 0's metrics plus the
  files of every rank that attached a checkpoint in its k-th call;
- metrics MUST be JSON-serialisable (numbers, strings, lists, dicts; numpy / 0-d tensor scalars
  are converted);
- after `report()` returns, the checkpoint's local directory may be deleted. With
  `checkpoint_upload_mode="async"` its files MUST NOT be rewritten in place until the upload is
  done (save each checkpoint into a new directory, or delete a file before writing it again): a
  file changed during its upload fails the rank;
- an asynchronous upload that fails raises at the rank's next report(), or when the training
  function returns; the function's return waits for the uploads still pending;
- `get_preemption_info()` turns non-None at the same report on every rank: the one after the
  first agreement started at or after the report at which some rank had notice (the next report
  with `agreement_interval_s=0`). A checkpoint reported then is committed before it goes.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .. import knobs
from ..errors import SessionError, StorageError
from ..protocol import Message, PreemptionInfo, Report, UploadIntent
from ..storage.checkpoint import Checkpoint
from ..storage.checkpoint_manager import checkpoint_dir_name
from ..storage.fs import Storage
from . import preemption
from .journal import Journal
from .snapshots import RankSnapshots, Saver, Snapshot, StateFn, jit_saver
from .uploads import Uploads


@dataclass
class RankSpec:
    """Everything one rank needs, sent by the driver with the rank's Dask task."""

    train_loop: str | Callable
    config: dict[str, Any]
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    name: str
    attempt: int
    attempt_id: str
    master_addr: str
    master_port: int
    backend: str
    use_gpu: bool
    storage: Storage
    checkpoint_dir: str | None  # latest committed checkpoint, None on a fresh run
    start_report_index: int
    topic: str
    collective_timeout_s: float  # FailureConfig.collective_timeout_s
    agreement_interval_s: float  # FailureConfig.agreement_interval_s
    extra: dict[str, Any] = field(default_factory=dict)
    snapshot_every: int | None = None  # CheckpointConfig.snapshot_every
    snapshot_holders: tuple[str, ...] = ()  # who hold this rank's snapshots (`snapshot_store`)
    snapshot: dict[str, Any] | None = None  # the snapshot round to restore, chosen by the driver


class TrainContext:
    """Where this rank sits in the group. Returned by `ft_train.get_context()`."""

    def __init__(self, spec: RankSpec):
        self._spec = spec

    def get_world_rank(self) -> int:
        return self._spec.rank

    def get_world_size(self) -> int:
        return self._spec.world_size

    def get_local_rank(self) -> int:
        return self._spec.local_rank

    def get_local_world_size(self) -> int:
        return self._spec.local_world_size

    def get_node_rank(self) -> int:
        return self._spec.node_rank

    def get_experiment_name(self) -> str:
        return self._spec.name

    def get_attempt(self) -> int:
        """0 for the run's first worker group, then one more for each restart."""
        return self._spec.attempt

    def __repr__(self) -> str:
        s = self._spec
        return (
            f"TrainContext(rank={s.rank}/{s.world_size}, local={s.local_rank}, attempt={s.attempt})"
        )


def _jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` as JSON carries them. NaN and infinity, at any depth, become the strings 'nan',
    'inf' and '-inf': a diverged loss is worth reporting (and must not fail the rank), but JSON
    has no such numbers, and the run state and the manifest must stay valid JSON for every
    reader. A checkpoint scored by such a metric ranks worst."""

    def scalar(o: Any) -> Any:
        if hasattr(o, "item") and getattr(o, "ndim", 0) == 0:
            return o.item()  # numpy scalar, 0-d tensor
        raise TypeError(f"{type(o).__name__} is not JSON-serialisable")

    if not isinstance(metrics, dict):
        raise SessionError(f"report(metrics=...) takes a dict, not {type(metrics).__name__}")
    try:
        out = json.loads(json.dumps(metrics, default=scalar))
    except (TypeError, ValueError) as e:
        raise SessionError(
            f"report(): metrics must be JSON-serialisable ({e}): report numbers, strings, lists "
            "and dicts (e.g. loss.item(), not the tensor; str(value) for anything else)"
        ) from None
    return _finite(out)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _checkpoint_files(checkpoint: Checkpoint, local: str) -> None:
    """A checkpoint's directory must exist. It may be empty on some ranks (only rank 0 saves
    the model); a round in which no rank attached a file is refused by the driver
    (`controller.Controller._on_round`)."""
    if not os.path.isdir(local):
        raise SessionError(
            f"report(checkpoint={checkpoint!r}): {local} is not a directory; save the "
            "checkpoint's files into a directory, then pass Checkpoint.from_directory(it)"
        )


UploadMode = Literal["sync", "async"]
UPLOAD_MODES = ("sync", "async")


class Session:
    def __init__(
        self, spec: RankSpec, send: Callable[[Message], None], journal: Journal | None = None
    ):
        self.spec = spec
        self.send = send
        self.journal = journal  # what must outlive this process (`ft_train.worker.journal`)
        self.report_index = spec.start_report_index
        self.context = TrainContext(spec)
        self.control = None  # a gloo group for ft-train's own agreement (set by run_rank)
        self.preemption: PreemptionInfo | None = None
        self._agreement: preemption.PendingAgreement | None = None  # not read yet
        self._agreement_index = 0  # the report index the latest agreement started at
        self._agreement_time: float | None = None  # and when (time.monotonic)
        self._next_agreement = spec.start_report_index + 1  # the next one starts at this report
        self.agreements = 0  # started so far
        self._uploads: Uploads | None = None  # created by the first asynchronous upload
        self.snapshots = RankSnapshots.of(spec)  # the in-memory tier (`ft_train.worker.snapshots`)

    def checkpoint(self) -> Checkpoint | None:
        s = self.spec
        if s.snapshot is not None:  # a snapshot round newer than the latest on storage
            return self.snapshots.restored(s.snapshot)
        if s.checkpoint_dir is None:
            return None
        return Checkpoint(s.storage.uri(f"{s.name}/{s.checkpoint_dir}"), s.storage.options)

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint: Checkpoint | None = None,
        checkpoint_upload_mode: UploadMode = "sync",
        snapshot: Snapshot | None = None,
    ) -> None:
        metrics = _jsonable(metrics)
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise SessionError(
                "report(checkpoint=...) takes ft_train.Checkpoint.from_directory(dir)"
            )
        if checkpoint_upload_mode not in UPLOAD_MODES:
            raise SessionError(
                f"report(checkpoint_upload_mode={checkpoint_upload_mode!r}): choose 'sync' (upload "
                "before report() returns) or 'async' (upload in the background)"
            )
        if self._uploads is not None:
            self._uploads.check()  # an earlier asynchronous upload failed: this rank fails
        self.report_index += 1
        s = self.spec
        msg = Report(s.rank, self.report_index, metrics)
        if self.control is not None:
            msg = self._agree(msg)
        self.snapshots.offer(snapshot, self.report_index)
        if checkpoint is not None:
            dir_name = checkpoint_dir_name(self.report_index, s.attempt, s.attempt_id)
            msg, remote = replace(msg, dir_name=dir_name), f"{s.name}/{dir_name}"
            with checkpoint.as_directory() as local:
                _checkpoint_files(checkpoint, local)
                if checkpoint_upload_mode == "async":
                    self._journal(UploadIntent(s.rank, self.report_index, dir_name))
                    self._uploads_started().submit(local, remote, msg)
                    self._returning()
                    return  # the message follows the upload (`_deliver`)
                msg = replace(msg, files=s.storage.upload_dir(local, remote, rank=s.rank))
            self._journal(msg)
        self._returning()
        self.send(msg)

    # Crash ordering: what report() journals is on the node before it returns; what it sends
    # may still be queued in this process. The driver reads the journals after a failure.
    def _journal(self, msg: Report | UploadIntent) -> None:
        if self.journal is not None:
            self.journal.append(msg)

    def _returning(self) -> None:
        if self.journal is not None:
            self.journal.reached(self.report_index)

    def _deliver(self, msg: Report) -> None:
        """An asynchronous upload is stored (on the upload thread): its message, journaled."""
        self._journal(msg)
        self.send(msg)

    def _agree(self, msg: Report) -> Report:
        """Read the agreement started at the previous report, if one was, and start the next
        one if this report is the one the group agreed on. Every rank starts and reads each
        agreement at the same report index, so all of them learn at the same report."""
        if self._agreement is not None:
            msg = self._read_agreement(msg)
        if self.report_index >= self._next_agreement:
            self._start_agreement()
        return msg

    def _read_agreement(self, msg: Report) -> Report:
        previous, self._agreement = self._agreement, None
        assert previous is not None  # started at an earlier report (_start_agreement)
        agreed = previous.result()
        if agreed.any_finished:
            raise SessionError(_UNEQUAL.format(self._agreement_index))
        if agreed.stop:
            raise preemption.GroupStop()
        if agreed.preemption is not None and self.preemption is None:
            self.preemption = info = agreed.preemption
            msg = replace(msg, preempted=info.ranks, deadline=info.deadline)
        self._next_agreement = self._agreement_index + agreed.every
        if self.journal is not None:
            self.journal.all_reached(self._agreement_index)
        return msg

    def _start_agreement(self) -> None:
        """Starting an agreement costs a rank a fraction of a millisecond on a busy CPU (the
        all-reduce's threads take its core), which a fast loop would feel. So the group
        agrees about every `agreement_interval_s`: each rank proposes how many reports that is,
        from their spacing since the previous agreement, and the group takes the largest
        proposal, at most knobs.AGREE_EVERY_MAX."""
        s, now = self.spec, time.monotonic()
        every = 1
        if s.agreement_interval_s > 0 and self._agreement_time is not None:
            per_report = (now - self._agreement_time) / (self.report_index - self._agreement_index)
            every = knobs.AGREE_EVERY_MAX
            if per_report > 0:
                every = max(1, min(knobs.AGREE_EVERY_MAX, int(s.agreement_interval_s / per_report)))
        self._agreement = preemption.PendingAgreement(
            self.control, s.rank, s.world_size, s.attempt_id, False, every, self.report_index
        )
        self._agreement_index, self._agreement_time = self.report_index, now
        self.agreements += 1

    def _uploads_started(self) -> Uploads:
        if self._uploads is None:
            self._uploads = Uploads(self.spec.storage, self._deliver)
        return self._uploads

    def finish(self) -> None:
        """The training function returned: wait for the uploads still pending, and check with
        the other ranks that they are done too."""
        if self._agreement is not None:
            previous, self._agreement = self._agreement, None
            if previous.result().any_finished:
                raise SessionError(_UNEQUAL.format(self._agreement_index))
        if self._uploads is not None:
            self._uploads.flush()  # raises a failed upload's error
        if self.control is not None:
            s = self.spec
            agreed = preemption.agree(
                self.control, s.rank, s.world_size, s.attempt_id, True, self.report_index
            )
            if not (agreed.all_finished and agreed.same_index):
                raise SessionError(_UNEQUAL.format(self.report_index + 1))

    def stopped(self, timeout_s: float = knobs.STOP_FLUSH_S) -> None:
        """The group is stopping (the driver's GroupStop, or a failure): give the pending
        uploads `timeout_s` to finish, so the rounds they complete can still be committed (the
        driver reads them from the journal), then drop the rest; a snapshot on its way too."""
        self.snapshots.wait(timeout_s)
        if self._uploads is not None:
            try:
                self._uploads.flush(timeout=timeout_s)
            except StorageError:
                pass  # that round is lost; the group restarts from a committed checkpoint anyway
        self.close()

    def close(self) -> None:
        """The rank is leaving: drop the uploads still pending and remove their snapshots."""
        if self._uploads is not None:
            self._uploads.close(timeout=1.0)
        self.snapshots.close()


_UNEQUAL = (
    "ranks called report() a different number of times: at report {}, some ranks had "
    "returned from the training function and others had not; every rank must call report() "
    "the same number of times"
)

_session: Session | None = None


def _current() -> Session:
    if _session is None:
        raise SessionError(
            "this ft_train call works only inside a training function run by ft-train "
            "(the train_loop of the `ft-train` flow)"
        )
    return _session


def install(session: Session | None) -> None:
    global _session
    _session = session
    preemption.rank_running(session is not None)  # a leaving worker waits for its rank


def get_context() -> TrainContext:
    """This rank's place in the group."""
    return _current().context


def get_checkpoint() -> Checkpoint | None:
    """The latest committed checkpoint, or None on a fresh run."""
    return _current().checkpoint()


def get_preemption_info() -> PreemptionInfo | None:
    """Set from the report() at which the group learned that workers are leaving (the same
    report on every rank), else None. Save a checkpoint and report it before `deadline`."""
    return _current().preemption


def enable_jit_checkpoint(save: Saver | None = None, *, files: StateFn | None = None) -> None:
    """Opt in to a just-in-time save when a peer fails (`ft_train.worker.snapshots`)."""
    _current().snapshots.jit_saver = jit_saver(save, files)


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_upload_mode: UploadMode = "sync",
    snapshot: Snapshot | None = None,
) -> None:
    """Report this step's metrics, optionally with a checkpoint. See the module docstring.

    `checkpoint_upload_mode`: "sync" uploads the checkpoint before report() returns; "async"
    snapshots its directory (hard links) and uploads it in the background, at most two at a
    time (report() waits beyond that). Either way the checkpoint is committed only once every
    file of its round is stored. `snapshot`: {file name: state} or save(directory), for the
    in-memory tier every `snapshot_every` reports (`ft_train.worker.snapshots`)."""
    _current().report(metrics, checkpoint, checkpoint_upload_mode, snapshot)
