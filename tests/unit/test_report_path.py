"""The report path in one process: staging directories and asynchronous uploads that fail or are
stopped (on two ranks, and with killed processes, in `tests/test_report_path.py`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import ft_train
from ft_train.storage.checkpoint import Checkpoint
from ft_train.storage.fs import Storage
from ft_train.worker.session import Session
from ft_train.worker.uploads import Uploads
from tests.helpers import wait_for
from tests.uploads import GatedStorage, block_checkpoint_path, spec, staged_dirs, write_checkpoint


def test_a_stopped_group_flushes_pending_uploads_and_a_failed_one_drops_them(tmp_path):
    class GateOpensOnFlush(Uploads):
        def flush(self, timeout=None):
            self.storage.gate.set()  # the held upload goes on only once stopped() waits for it
            return super().flush(timeout)

    def pending(tag: str):
        """A session with one asynchronous upload held in flight."""
        st = GatedStorage(str(tmp_path / f"runs-{tag}"))
        msgs: list = []
        session = Session(spec(st), msgs.append)
        staging = str(tmp_path / f"staging-{tag}")
        session._uploads = GateOpensOnFlush(st, msgs.append, staging_root=staging)
        local = write_checkpoint(tmp_path, {"w.pt": b"w" * 100})
        session.report({"i": 1}, Checkpoint.from_directory(local), checkpoint_upload_mode="async")
        wait_for(lambda: st.started, 30, "the upload to start")
        return session, st, msgs, staging

    # GroupStop (a resize): the pending upload may finish, so its round can still be committed
    session, st, msgs, staging = pending("stop")
    session.stopped()
    assert [m.index for m in msgs] == [1] and msgs[0].files
    assert os.listdir(staging) == []

    # a failed group: the pending upload is dropped, never reported, its snapshot removed
    session, st, msgs, staging = pending("fail")
    session.close()  # does not wait for the held upload (nor open the gate)
    st.gate.set()  # the upload resumes, sees that it was dropped, and stops
    wait_for(lambda: os.path.isdir(staging) and not os.listdir(staging), 30, "the cleanup")
    assert msgs == []


def test_a_failed_upload_fails_the_next_report_and_leaves_no_snapshot(tmp_path):
    st = Storage(str(tmp_path / "runs"))
    staging = str(tmp_path / "staging")
    session = Session(spec(st), [].append)
    session._uploads = Uploads(st, session.send, staging_root=staging)
    block_checkpoint_path(st.url, "run", 1)
    local = write_checkpoint(tmp_path, {"w.pt": b"w"})
    session.report({"i": 1}, Checkpoint.from_directory(local), checkpoint_upload_mode="async")
    # the snapshot is removed only once the failure is latched
    wait_for(lambda: not staged_dirs(staging), 30, "the upload to fail")
    with pytest.raises(ft_train.StorageError, match="asynchronous upload of report 1"):
        session.report({"i": 2})
    session.close()


def test_staging_dir_is_in_memory_when_the_checkpoint_fits_and_is_removed_after(tmp_path):
    with ft_train.staging_dir(2**20) as d:
        assert d.startswith("/dev/shm/"), d  # this machine has a tmpfs there with room
        Path(d, "model.pt").write_bytes(b"x" * 2**20)
    assert not os.path.exists(d)
    for size in (None, 2**60):  # no size given, or more than fits: on disk
        with ft_train.staging_dir(size) as d:
            assert Path(d).is_relative_to(tempfile.gettempdir()) and os.listdir(d) == []
    with pytest.raises(RuntimeError, match="boom"):
        with ft_train.staging_dir(2**20) as d:
            raise RuntimeError("boom")
    assert not os.path.exists(d)
    for bad in (-1, 1.5, "1GB"):
        with pytest.raises(ft_train.SessionError, match="size_bytes"):
            with ft_train.staging_dir(bad):
                pass
