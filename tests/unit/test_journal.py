"""The journal of reports a rank writes on its node (`ft_train.worker.journal`), read and swept in
one process; a process killed right after `report()` returned is in `tests/test_journal.py`."""

from __future__ import annotations

import os

from ft_train.protocol import Report, UploadIntent
from ft_train.worker.journal import Journal, collect


def test_what_a_rank_journaled_is_collected_once_then_removed(tmp_path):
    journal = Journal("run", "attempt", rank=1, root=str(tmp_path))
    journal.joined(4)
    journal.append(Report(1, 5, {"loss": 0.5}, "checkpoint_000005-a0-x", {"w.pt": {"size": 1}}))
    journal.reached(5)
    journal.append(UploadIntent(1, 6, "checkpoint_000006-a0-x"))
    journal.reached(6)
    found = collect("run", "attempt", root=str(tmp_path))
    assert found[1]["index"] == 6
    assert [m.get("upload") for m in found[1]["messages"]] == [None, "pending"]
    assert found[1]["messages"][0]["files"] == {"w.pt": {"size": 1}}
    assert collect("run", "attempt", root=str(tmp_path)) == {}
    assert not (tmp_path / "run").exists()


def test_a_rank_that_never_joined_has_no_index(tmp_path):
    Journal("run", "attempt", rank=0, root=str(tmp_path))
    assert collect("run", "attempt", root=str(tmp_path)) == {0: {"messages": []}}


def test_once_every_rank_reached_a_report_the_older_lines_go(tmp_path):
    journal = Journal("run", "attempt", rank=0, root=str(tmp_path))
    for index in (4, 8, 12, 16):
        journal.append(Report(0, index, {}, f"checkpoint_{index:06d}-a0-x", {}))
    journal.all_reached(13)  # 12 may still be the newest round every rank reached: it stays
    kept = [m["index"] for m in collect("run", "attempt", root=str(tmp_path))[0]["messages"]]
    assert kept == [12, 16]


def test_a_later_attempt_sweeps_the_journals_of_the_earlier_ones(tmp_path):
    Journal("run", "first", rank=0, root=str(tmp_path)).joined(0)
    Journal("run", "second", rank=0, root=str(tmp_path))
    assert os.listdir(tmp_path / "run") == ["second"]
