"""A rank's journal (`ft_train.worker.journal`): what report() leaves outside its process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from ft_train.worker.journal import collect


def test_the_journal_outlives_a_process_killed_the_instant_after_report_returned(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from ft_train.worker.journal import Journal
        from ft_train.protocol import Report
        journal = Journal("run", "attempt", rank=1, root={str(tmp_path)!r})
        journal.joined(0)
        journal.append(Report(1, 1, {{}}, "checkpoint_000001-a0-x", {{"a": {{}}}}))
        journal.reached(1)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code])
    assert proc.returncode == -signal.SIGKILL
    found = collect("run", "attempt", root=str(tmp_path))
    assert found[1]["index"] == 1 and found[1]["messages"][0]["dir_name"].startswith(
        "checkpoint_000001"
    )
