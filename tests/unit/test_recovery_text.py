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
