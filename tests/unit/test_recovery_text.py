"""What `ft-train status` and the summary say of a run's progress and recoveries, from run states
built by hand: counts in reports, each recovery's cost, plurals (`cli.output`, `cli.runs`)."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

from cli.output import print_recoveries, recovery_costs
from ft_train.storage.run_state import AttemptRecord, FailureRecord, RunState
from ft_train.wording import after_report, plural

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_stored_run_from_before_reports_were_kept_counts_its_latest_checkpoints_round():
    old = RunState.model_validate({"name": "r", "report_index": 18, "status": "finished"})
    assert old.reports == 18
    new = RunState.model_validate({"name": "r", "report_index": 18, "reports": 20})
    assert new.reports == 20


def test_a_recovery_costs_the_reports_since_the_restored_round_and_the_wait_for_progress():
    state = RunState(name="r")
    state.attempts = [
        AttemptRecord(attempt=0, attempt_id="a0", world_size=2, started_at=at(0)),
        AttemptRecord(
            attempt=1,
            attempt_id="a1",
            world_size=2,
            restored_from="checkpoint_000012",
            start_report_index=12,
            started_at=at(30),
            first_report_at=at(32.5),
        ),
        AttemptRecord(
            attempt=2,
            attempt_id="a2",
            world_size=1,
            restored_from="checkpoint_000012",
            start_report_index=12,
            started_at=at(40),
        ),
    ]
    state.failures = [
        FailureRecord(
            kind="driver_crash",
            step=15,
            reports=15,
            last_report_at=at(9.5),
            time=at(29.9),
            attempt=0,
            charged=False,
        ),
        FailureRecord(kind="process_death", rank=1, step=13, reports=13, time=at(39), attempt=1),
    ]
    crash, death = recovery_costs(state)
    assert (crash.reports_before, crash.reports_lost, crash.gap_s) == (15, 3, 23.0)
    assert crash.gap == "from the last progress to the first resumed report"
    assert (death.reports_before, death.reports_lost, death.gap_s) == (13, 1, 1.0)
    assert death.gap == "from the failure to the restart"  # neither end recorded: said so
    out = io.StringIO()
    print_recoveries(state, out)
    assert out.getvalue().splitlines() == [
        "  recovery     driver_crash after report 15 -> 2 ranks resumed from report 12: "
        "3 reports lost, 23.0 s from the last progress to the first resumed report",
        "               process_death on rank 1 after report 13 -> 1 rank resumed from report 12: "
        "1 report lost, 1.0 s from the failure to the restart",
    ]


def test_counts_agree_with_their_nouns():
    assert [plural(n, "failure") for n in (0, 1, 2)] == ["0 failures", "1 failure", "2 failures"]
    assert after_report(0) == "before the first report" and after_report(7) == "after report 7"


def test_the_journals_say_how_far_every_rank_got_and_when_the_attempt_first_reported(tmp_path):
    """What the driver counts a recovery from when the ranks' last reports died queued in them:
    the newest report every rank returned from, and when every rank had first reported."""
    from ft_train.worker import journal

    ranks = [journal.Journal("run", "a1", r, root=str(tmp_path)) for r in (0, 1)]
    for j in ranks:
        j.joined(6)  # restored from report 6: not a report of this attempt
    before = journal.progress("run", "a1", 2, root=str(tmp_path))  # as a new driver reads it
    assert before is not None and (before.index, before.first_at) == (6, None)
    ranks[0].reached(7)
    ranks[1].reached(7)
    ranks[0].reached(8)  # rank 1 died before it returned from report 8
    found = journal.collect("run", "a1", root=str(tmp_path))
    got = journal.reached(found, 2)
    assert got is not None and got.index == 7
    assert got.first_at == max(found[0]["first_at"], found[1]["first_at"])
    assert got.at == found[1]["at"]  # rank 1 stopped at 7: when it got there
    assert journal.reached({0: found[0]}, 2) is None  # a rank's journal lost: unknown
