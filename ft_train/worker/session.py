"""The worker-side API: `get_context()`, `get_checkpoint()`, `report()`.

A rank runs the user's training function inside a `Session`, installed for the duration of the
call. `report()` sends one small message to the driver and returns: it never waits for the
driver. With a checkpoint attached, the checkpoint's files go into a directory named after the
report index and the attempt: uploaded before the message is sent (`checkpoint_upload_mode=
"sync"`, the default), or snapshotted and uploaded in the background, the message following the
upload (`"async"`, see `ft_train.worker.uploads`).

report() also agrees with the other ranks on what they must all learn at the same call (a
worker's preemption notice, the driver's request to stop, a rank that returned early). That
agreement is an all-reduce over a small gloo group, started in the background at one agreement
point and read at the next, so a call does not wait for the slowest rank: what the ranks agree
on at point k+1 is what they knew at point k. The agreement points are report(),
get_preemption_info() (so that it may be polled between reports) and ft_train.collective's
calls, one ordered sequence on every rank. With points closer together than
`FailureConfig.agreement_interval_s` (0.25 s), the ranks start one only every few points (at
most `knobs.AGREE_EVERY_MAX`), the same ones on every rank. Each agreement carries its point's
number, kind and report count: ranks whose sequences differ fail with a SessionError, not a hang.

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
- every rank MUST call get_preemption_info() the same number of times too, at the same places
  between its reports; it turns non-None at the same call on every rank: the point after the
  first agreement started at or after the call at which some rank had notice (the next call
  with `agreement_interval_s=0`). A checkpoint reported at or after it, before the notice's
  deadline, is committed before the worker goes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .. import knobs, report_config
from ..errors import SessionError, StorageError
from ..protocol import (
    Agreement,
    Message,
    Point,
    PreemptionInfo,
    RankSpec,
    Report,
    UploadIntent,
)
from ..ray_names import RefusesRayNames
from ..report_config import CheckpointConsistencyMode, CheckpointUploadMode, UploadMode
from ..snapshots.rank import RankSnapshots, Saver, Snapshot, StateFn, jit_saver
from ..storage import checkpoint_manager
from ..storage.checkpoint import Checkpoint
from . import preemption, reported_checkpoints
from .checkpoint_labels import Labels
from .journal import Journal
from .reported_checkpoints import ReportedCheckpoint
from .uploads import Uploads


class TrainContext(RefusesRayNames):
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
        self._untold = False  # learned between reports: the next report's message tells the driver
        # Agreement points, counted from 1 in each attempt: report(), get_preemption_info(),
        # ft_train.collective's calls (`_point`). The latest agreement started at point
        # `_agreement_point`, of kind `_agreement_kind`, after `_agreement_index` reports.
        self.points = 0
        self._agreement: preemption.PendingAgreement | None = None  # not read yet
        self._agreement_point, self._agreement_kind = 0, Point.REPORT
        self._agreement_index = spec.start_report_index
        self._agreement_time: float | None = None  # and when (time.monotonic)
        self._next_agreement = 1  # the next one starts at this point
        self.agreements = 0  # started so far
        self._uploads: Uploads | None = None  # created by the first asynchronous upload
        self._labels = Labels(spec.storage, spec.name)  # report(checkpoint_dir_name=...)
        self._last_checkpoint = 0  # the last report index this rank attached a checkpoint at
        self.snapshots = RankSnapshots.of(spec)  # the in-memory tier (`ft_train.snapshots`)

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
        checkpoint_dir_name: str | None = None,
        checkpoint_upload_mode: CheckpointUploadMode | UploadMode = CheckpointUploadMode.SYNC,
        delete_local_checkpoint_after_upload: bool | None = None,
        checkpoint_upload_fn: Callable | None = None,
        validation: Any = False,
        snapshot: Snapshot | None = None,
    ) -> None:
        metrics = _jsonable(metrics)
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise SessionError(
                "report(checkpoint=...) takes ft_train.Checkpoint.from_directory(dir)"
            )
        mode, label, delete = report_config.checked(
            checkpoint,
            checkpoint_dir_name,
            checkpoint_upload_mode,
            delete_local_checkpoint_after_upload,
            checkpoint_upload_fn,
            validation,
        )
        if self._uploads is not None:
            self._uploads.check()  # an earlier asynchronous upload failed: this rank fails
        if checkpoint is not None and label is not None:
            self._labels.claim(label, self.report_index + 1)  # before anything is uploaded
        self.report_index += 1
        s = self.spec
        msg = Report(s.rank, self.report_index, metrics, label=label)
        if self.control is not None:
            msg = self._agree(msg)
        self.snapshots.offer(snapshot, self.report_index)
        if checkpoint is not None:
            self._last_checkpoint = self.report_index
            dir_name = checkpoint_manager.checkpoint_dir_name(
                self.report_index, s.attempt, s.attempt_id, label
            )
            msg, remote = replace(msg, dir_name=dir_name), f"{s.name}/{dir_name}"
            with checkpoint.as_directory() as local:
                _checkpoint_files(checkpoint, local)
                if mode == "async":
                    self._journal(UploadIntent(s.rank, self.report_index, dir_name))
                    # the snapshot (hard links) holds the files from here on
                    self._uploads_started().submit(local, remote, msg)
                else:
                    msg = replace(msg, files=s.storage.upload_dir(local, remote, rank=s.rank))
            if delete:  # Ray's delete_local_checkpoint_after_upload
                shutil.rmtree(local)
            if mode == "async":
                self._returning()
                return  # the message follows the upload (`_deliver`)
            self._journal(msg)
        self._returning()
        self.send(msg)

    def all_reported(
        self, consistency_mode: CheckpointConsistencyMode, timeout_s: float | None
    ) -> list[ReportedCheckpoint]:
        """`get_all_reported_checkpoints()` (`ft_train.worker.reported_checkpoints`): waits for
        the commit of the last checkpoint this rank attached in this attempt."""
        reported_checkpoints.check_mode(consistency_mode, timeout_s)
        s = self.spec
        return reported_checkpoints.all_reported(
            s.storage, s.name, self._last_checkpoint, timeout_s
        )

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
        """report()'s agreement point. Its message tells the driver of a notice the group
        learned here or since the previous report."""
        known = self.preemption
        self._point(Point.REPORT)
        if known is not None and not known.reported:  # the report after the notice
            self.preemption = replace(known, reported=True)
        if self._untold:
            info, self._untold = self.preemption, False
            assert info is not None  # set with _untold (_read_agreement)
            msg = replace(msg, preempted=info.ranks, deadline=info.deadline)
        return msg

    def poll(self) -> PreemptionInfo | None:
        """get_preemption_info(): an agreement point, then what the group has agreed on."""
        if self.control is not None:
            self._point(Point.POLL)
        return self.preemption

    def _point(self, kind: Point) -> None:
        """Read the agreement started at the previous point, if one was, and start the next one
        if this point is the one the group agreed on. Every rank passes the same points in the
        same order (report(), get_preemption_info() and ft_train.collective's calls, each the
        same number of times), so every rank starts and reads each agreement at the same point,
        and all of them learn at the same call."""
        self.points += 1
        if self._agreement is not None:
            self._read_agreement()
        if self.points >= self._next_agreement:
            self._start_agreement(kind)

    def sync_point(self, kind: Point, payload: int = 0) -> Agreement:
        """A collective's agreement point (`ft_train.collective`): the pending agreement is
        read first, then this one runs and is waited for, so the control group carries one
        operation at a time, in the same order on every rank. A rank at another point fails
        here with the others, rather than pairing its operations with theirs."""
        self.points += 1
        if self.control is None:  # no group to agree with (a session made by hand)
            return Agreement(self.preemption, False, False, False, 1, True, payload)
        if self._agreement is not None:
            self._read_agreement()
        self._start_agreement(kind, payload)
        return self._read_agreement()

    def _read_agreement(self) -> Agreement:
        previous, self._agreement = self._agreement, None
        assert previous is not None  # started at an earlier point (_start_agreement)
        agreed = previous.result()
        if agreed.any_finished:
            raise SessionError(_UNEQUAL.format(self._agreement_index))
        if not agreed.same_index:
            raise SessionError(
                _OUT_OF_STEP.format(
                    self._agreement_point, self._agreement_kind.call(), self._agreement_index
                )
            )
        if agreed.stop:
            raise preemption.GroupStop()
        if agreed.preemption is not None and self.preemption is None:
            self.preemption, self._untold = agreed.preemption, True
        self._next_agreement = self._agreement_point + agreed.every
        if self.journal is not None:
            self.journal.all_reached(self._agreement_index)
        return agreed

    def _start_agreement(self, kind: Point, payload: int = 0) -> None:
        """Starting an agreement costs a rank a fraction of a millisecond on a busy CPU (the
        all-reduce's threads take its core), which a fast loop would feel. So the group
        agrees about every `agreement_interval_s`: each rank proposes how many points that is,
        from their spacing since the previous agreement, and the group takes the largest
        proposal, at most knobs.AGREE_EVERY_MAX."""
        s, now = self.spec, time.monotonic()
        every = 1
        if s.agreement_interval_s > 0 and self._agreement_time is not None:
            per_point = (now - self._agreement_time) / (self.points - self._agreement_point)
            every = knobs.AGREE_EVERY_MAX
            if per_point > 0:
                every = max(1, min(knobs.AGREE_EVERY_MAX, int(s.agreement_interval_s / per_point)))
        self._agreement = preemption.PendingAgreement(
            self.control,
            s.rank,
            s.world_size,
            s.attempt_id,
            False,
            every,
            self.points,
            kind,
            self.report_index,
            payload,
        )
        self._agreement_point, self._agreement_kind = self.points, kind
        self._agreement_index, self._agreement_time = self.report_index, now
        self.agreements += 1

    def _uploads_started(self) -> Uploads:
        if self._uploads is None:
            self._uploads = Uploads(self.spec.storage, self._deliver)
        return self._uploads

    def finish(self) -> None:
        """The training function returned: wait for the uploads still pending, and check with
        the other ranks that they are done too. Raises GroupStop where the ranks returned
        after learning of a notice that no report has told the driver."""
        if self._agreement is not None:
            previous, self._agreement = self._agreement, None
            agreed = previous.result()
            if agreed.any_finished:
                raise SessionError(_UNEQUAL.format(self._agreement_index))
            if not agreed.same_index:
                raise SessionError(
                    _OUT_OF_STEP.format(
                        self._agreement_point, self._agreement_kind.call(), self._agreement_index
                    )
                )
        if self._uploads is not None:
            self._uploads.flush()  # raises a failed upload's error
        if self.control is not None:
            s = self.spec
            agreed = preemption.PendingAgreement(
                self.control,
                s.rank,
                s.world_size,
                s.attempt_id,
                True,
                index=self.points + 1,
                kind=Point.FINISH,
                reports=self.report_index,
            ).result()
            if not (agreed.all_finished and agreed.same_index):
                raise SessionError(_UNEQUAL.format(self.report_index + 1))
        if self._untold:
            # The ranks learned of a notice between reports and returned without another: the
            # loop stopped for it (as ft-train's examples do once they have saved), and no
            # report told the driver. Leave as a stopped group: the driver restarts from the
            # latest checkpoint, as after a report that told it.
            raise preemption.GroupStop()

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
    "ranks called report() (or get_preemption_info(), or ft_train.collective's functions) a "
    "different number of times: at report {}, some ranks had returned from the training "
    "function and others had not; every rank must call report() and get_preemption_info() "
    "the same number of times"
)
_OUT_OF_STEP = (
    "ranks called report(), get_preemption_info() and ft_train.collective's functions a "
    "different number of times or in another order: this rank's call {} of this attempt was "
    "{} (after report {}), and another rank's call of that number was not the same; every "
    "rank must make these calls the same number of times, in the same order (poll "
    "get_preemption_info() at the same place of every step, on every rank)"
)

_session: Session | None = None


def _current() -> Session:
    if _session is None:
        raise SessionError(
            "this ft_train call works only inside a training function run by ft-train "
            "(the train_loop of the `ft-train` flow)"
        )
    return _session


def current_session() -> Session:
    """The running rank's session (for ft_train's own modules); SessionError outside one."""
    return _current()


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
    """None until the group has learned that workers are leaving, then a `PreemptionInfo`
    (which ranks leave, and by when) for the rest of the attempt. May be polled at every step,
    as Ray's pattern does: every rank that calls report() and get_preemption_info() the same
    number of times, in the same order, gets the answer at the same call. A call costs about a
    microsecond; every `FailureConfig.agreement_interval_s` or so, one call reads the
    agreement started at the previous one (it waits for the slowest rank to have made that
    call) and starts the next in the background. A rank whose calls differ in number or order
    fails with a SessionError, in every rank, at the next agreement (or when the function
    returns). The notice reaches the ranks within `agreement_interval_s` of calls (at most
    `knobs.AGREE_EVERY_MAX` calls), plus one.

    Save a checkpoint and report it before `deadline`: a checkpoint reported at or after the
    call that first returned the notice is committed before the worker goes, then the group
    restarts elsewhere from it. The answer stays non-None after that report, so a loop that
    polls at every step tells it has saved by `info.reported` (True once report() has been
    called since that call: the same call on every rank), or by a flag of its own as in Ray's
    example:

        saved = False
        for step in ...:
            train_step()
            info = ft_train.get_preemption_info()
            if info is not None and not saved:  # or: `and not info.reported`
                ft_train.report(metrics, checkpoint=save_checkpoint())
                saved = True
    """
    return _current().poll()


def enable_jit_checkpoint(save: Saver | None = None, *, files: StateFn | None = None) -> None:
    """Opt in to a just-in-time save when a peer fails (`ft_train.snapshots`): when
    another rank of the group fails, this rank saves its state before it stops, and the restart
    resumes from that save when it is newer than the latest checkpoint or snapshot round.

    Give one of two forms: `save(directory)`, a function that writes this rank's state into the
    directory (as for a checkpoint); or `files()`, a function that returns the state as
    report(snapshot=...) takes it, {file name: state}, which is copied into one buffer in a few
    ms, with no torch.save until a restore needs the files. Both, or neither, is a SessionError."""
    _current().snapshots.jit_saver = jit_saver(save, files)


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode | UploadMode = CheckpointUploadMode.SYNC,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Callable | None = None,
    validation: Any = False,
    *,
    snapshot: Snapshot | None = None,
) -> None:
    """Report this step's metrics, optionally with a checkpoint. See the module docstring.
    Ray's `ray.train.report`, with Ray's arguments in Ray's order (`ft_train.report_config`):

    `checkpoint_dir_name`: the checkpoint's name, one path segment (e.g. f"epoch_{epoch}"). Its
    storage directory ends with it (`checkpoint_000012-a0-1f2e3d4c-epoch_3`: the report index
    and the attempt come first, so a directory is never reused), and so does its path in the
    result. Every rank that attaches files (or passes a name) in a round must pass the same
    name; a name that a checkpoint the run keeps already has, or that this rank used earlier in
    this attempt, is refused (`ft_train.worker.checkpoint_labels`).
    `checkpoint_upload_mode`: `CheckpointUploadMode.SYNC` ("sync") uploads the checkpoint before
    report() returns; `ASYNC` ("async") snapshots its directory (hard links) and uploads it in
    the background, at most two at a time (report() waits beyond that). Either way the
    checkpoint is committed only once every file of its round is stored. `NO_UPLOAD` is refused.
    `delete_local_checkpoint_after_upload`: remove the checkpoint's local directory once its
    files are uploaded (SYNC) or snapshotted (ASYNC: the snapshot holds them until uploaded);
    by default, as in Ray, only with `CheckpointUploadMode.ASYNC` (the string "async" keeps
    ft-train's meaning: the directory is left to the caller). A committed checkpoint reported
    again is never deleted.
    `checkpoint_upload_fn`, `validation`: not supported, refused (SessionError).
    `snapshot`: this rank's state for the in-memory tier, taken at every
    `CheckpointConfig.snapshot_every`-th report and ignored at the others: {file name: state},
    copied into one buffer kept from one snapshot to the next and sent to the holders in the
    background (a restore saves the files with torch.save), or a function save(directory)
    called in report() (`ft_train.snapshots`)."""
    if checkpoint_upload_fn is not None or validation:  # refused wherever it is called
        report_config.refuse_unsupported(checkpoint_upload_fn, validation)
    _current().report(
        metrics,
        checkpoint,
        checkpoint_dir_name,
        checkpoint_upload_mode,
        delete_local_checkpoint_after_upload,
        checkpoint_upload_fn,
        validation,
        snapshot,
    )


def get_all_reported_checkpoints(
    consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
    timeout_s: float | None = None,
) -> list[ReportedCheckpoint]:
    """The run's committed checkpoints, oldest first, each a `ReportedCheckpoint(checkpoint,
    metrics, status)`: those of earlier attempts and driver runs, and this attempt's. Waits until
    every checkpoint this rank attached in this attempt is committed (at most `timeout_s`; None:
    no limit). Ray's `ray.train.get_all_reported_checkpoints`; where it differs (a round where
    only other ranks attached files), see `ft_train.worker.reported_checkpoints`."""
    return _current().all_reported(consistency_mode, timeout_s)
