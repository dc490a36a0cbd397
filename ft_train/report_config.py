"""report()'s arguments with Ray Train's names: the enums `CheckpointUploadMode` and
`CheckpointConsistencyMode` (Ray's `ray.train.CheckpointUploadMode` and
`ray.train.CheckpointConsistencyMode`, same members and values), and the checks that turn what a
training function passes to `ft_train.report()` into what the session does, or refuse it.

Everything here runs on the rank before anything is uploaded, and refuses with a `SessionError`
(a broken contract: the rank fails and the run is not retried, since every retry would fail the
same way). Where Ray's meaning is not implemented, the message names what to use instead.

- `checkpoint_upload_mode`: `CheckpointUploadMode.SYNC` / `"sync"` (the default: uploaded before
  report() returns) or `ASYNC` / `"async"` (snapshotted, uploaded in the background).
  `NO_UPLOAD` (Ray: the checkpoint already sits in the run's storage directory) is refused: a
  directory the training function wrote into storage itself has no manifest and could mix files
  of two attempts (DESIGN storage invariant 3).
- `delete_local_checkpoint_after_upload`: Ray's default, True for `CheckpointUploadMode.ASYNC`
  only (not for the string "async", which keeps its meaning: the directory is the caller's).
- `checkpoint_dir_name`: a label, one path segment (`checkpoint_label`); it becomes the end of
  the checkpoint's storage directory name (`storage.checkpoint_manager.checkpoint_dir_name`).
- `checkpoint_upload_fn` and `validation`: refused by name.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal

from .errors import SessionError
from .storage.checkpoint import Checkpoint


class CheckpointUploadMode(Enum):
    """How report() uploads a checkpoint (Ray's `ray.train.CheckpointUploadMode`)."""

    ASYNC = "ASYNC"  # snapshotted, uploaded in the background; report() returns at once
    SYNC = "SYNC"  # uploaded before report() returns (the default)
    NO_UPLOAD = "NO_UPLOAD"  # Ray: already in the run's storage directory. Refused by ft-train.

    def _default_delete_local_checkpoint_after_upload(self) -> bool:
        return self == CheckpointUploadMode.ASYNC


class CheckpointConsistencyMode(Enum):
    """What `get_all_reported_checkpoints()` waits for (Ray's `ray.train.CheckpointConsistencyMode`).
    ft-train validates no checkpoint (`report(validation=...)` is refused), so both wait for the
    same thing: the commit of the checkpoints this rank reported."""

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


UploadMode = Literal["sync", "async"]
UPLOAD_MODES = ("sync", "async")

# A label is one path segment that reads the same on every filesystem and in a URL: letters,
# digits and . _ - = + , @ (Ray's own default, checkpoint_%Y-%m-%d_%H-%M-%S.%f, is one).
LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+,@-]*$")
MAX_LABEL = 200  # the directory name adds about 30 characters; most filesystems allow 255


def upload_mode(mode: Any) -> UploadMode:
    """`checkpoint_upload_mode` as "sync" or "async": the enum, or today's strings."""
    if isinstance(mode, CheckpointUploadMode):
        if mode is CheckpointUploadMode.NO_UPLOAD:
            raise SessionError(
                "report(checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD) is not supported: "
                "ft-train commits only files it uploaded itself (it writes their manifest); pass "
                "the checkpoint's local directory with CheckpointUploadMode.SYNC (upload before "
                "report() returns) or CheckpointUploadMode.ASYNC (upload in the background)"
            )
        return "async" if mode is CheckpointUploadMode.ASYNC else "sync"
    if isinstance(mode, str) and mode in UPLOAD_MODES:
        return mode  # type: ignore[return-value]  # one of UPLOAD_MODES
    raise SessionError(
        f"report(checkpoint_upload_mode={mode!r}): choose CheckpointUploadMode.SYNC (or 'sync': "
        "upload before report() returns) or CheckpointUploadMode.ASYNC (or 'async': upload in "
        "the background)"
    )


def delete_after_upload(delete: Any, mode: CheckpointUploadMode | UploadMode) -> bool:
    """`delete_local_checkpoint_after_upload`. Its default is Ray's for Ray's enum (True for
    `CheckpointUploadMode.ASYNC` only), and False for ft-train's own strings: "async" has always
    left the directory to the training function, and code written for it deletes it itself."""
    if delete is None:
        return mode is CheckpointUploadMode.ASYNC
    if not isinstance(delete, bool):
        raise SessionError(
            f"report(delete_local_checkpoint_after_upload={delete!r}): pass True, False, or None "
            "(Ray's default: True with CheckpointUploadMode.ASYNC, else False)"
        )
    return delete


def checkpoint_label(label: Any) -> str | None:
    """`checkpoint_dir_name`, checked: None, or one path segment of safe characters."""
    if label is None:
        return None
    if not isinstance(label, str):
        raise SessionError(
            f"report(checkpoint_dir_name={label!r}): pass a string (e.g. f'epoch_{{epoch}}'), "
            "or None for ft-train's own name"
        )
    if not LABEL.match(label) or len(label) > MAX_LABEL:
        raise SessionError(
            f"report(checkpoint_dir_name={label!r}): a checkpoint's name must be one path "
            f"segment of at most {MAX_LABEL} characters: letters, digits and . _ - = + , @, "
            "starting with a letter or a digit (e.g. 'epoch_3' or 'step=1200')"
        )
    return label


def refuse_unsupported(checkpoint_upload_fn: Any, validation: Any) -> None:
    """Ray's `checkpoint_upload_fn` and `validation` have no ft-train meaning yet: refused."""
    if checkpoint_upload_fn is not None:
        raise SessionError(
            "report(checkpoint_upload_fn=...) is not supported: ft-train uploads every "
            "checkpoint itself, through fsspec, and commits it with a manifest; configure the "
            "upload with RunConfig(storage_path=..., storage_options={...}) (endpoint, "
            "credentials, ...), and pass the local directory as checkpoint="
        )
    if validation is not False and validation is not None:
        raise SessionError(
            f"report(validation={validation!r}) is not supported: ft-train runs no validation "
            "task; validate in the training function (e.g. on rank 0, on the model it just "
            "saved) and report the result as a metric"
        )


def checked(
    checkpoint: Checkpoint | None,
    checkpoint_dir_name: Any,
    checkpoint_upload_mode: Any,
    delete_local_checkpoint_after_upload: Any,
    checkpoint_upload_fn: Any,
    validation: Any,
) -> tuple[UploadMode, str | None, bool]:
    """report()'s Ray arguments as (upload mode, label, delete the local directory after the
    upload), or a SessionError."""
    if (  # a metrics-only report with the defaults skips the checks: it is the hot path
        checkpoint is None
        and checkpoint_dir_name is None
        and checkpoint_upload_mode is CheckpointUploadMode.SYNC
        and delete_local_checkpoint_after_upload is None
        and checkpoint_upload_fn is None
        and validation is False
    ):
        return "sync", None, False
    mode = upload_mode(checkpoint_upload_mode)
    refuse_unsupported(checkpoint_upload_fn, validation)
    label = checkpoint_label(checkpoint_dir_name)
    given = delete_local_checkpoint_after_upload
    delete = delete_after_upload(given, checkpoint_upload_mode)
    if checkpoint is None or not delete:
        return mode, label, False
    if checkpoint.is_committed():  # reported again (e.g. get_checkpoint()'s): never deleted
        if given is True:
            raise SessionError(
                f"report(checkpoint={checkpoint!r}, delete_local_checkpoint_after_upload=True): "
                "that is a committed checkpoint, not a local directory, and ft-train never "
                "deletes a committed checkpoint's files (the run's storage, or the node's "
                "download cache): pass False, or report a local copy (checkpoint.to_directory())"
            )
        return mode, label, False  # the default: keep it
    return mode, label, True
