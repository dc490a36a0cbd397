"""The failure policy's decision and the error that ends a run, on run states built in memory."""

from ft_train import knobs
from ft_train.config import FailureConfig
from ft_train.policy import failure as failure_policy
from ft_train.policy.failure import Decision
from ft_train.storage.run_state import FailureRecord, RunState


def judged(state: RunState, failure: FailureRecord, config: FailureConfig, start_failures: int = 0):
    state.failures.append(failure)
    decision = failure_policy.decide(
        failure, state, config.max_failures, config.max_preemption_failures, start_failures
    )
    return decision, failure_policy.final_error(failure, state, config, start_failures)


def test_preemptions_spend_their_own_budget_and_the_error_lists_only_them():
    state = RunState(name="r")
    config = FailureConfig(max_failures=5, max_preemption_failures=1)
    first = FailureRecord(kind="preemption", rank=0, step=3, error="told to leave", charged=False)
    crash = FailureRecord(kind="exception", rank=1, step=4, error="boom")
    assert judged(state, first, config)[0] is Decision.RETRY
    assert judged(state, crash, config)[0] is Decision.RETRY  # max_failures is not spent by it
    second = FailureRecord(
        kind="preemption", rank=1, step=9, error="told to leave again", charged=False
    )
    decision, error = judged(state, second, config)
    assert decision is Decision.RAISE
    message = str(error)
    assert "2 failures exceed max_preemption_failures=1" in message
    assert "(run_config.failure_config.max_preemption_failures)" in message
    assert "told to leave again" in message and "boom" not in message
    assert len(error.failures) == 3  # every failure since the budget was reset, for the record


def test_charged_failures_since_the_budget_was_reset_are_the_ones_listed():
    state = RunState(name="r")
    state.failures.append(FailureRecord(kind="exception", rank=0, step=1, error="before the reset"))
    state.budget_start = 1
    config = FailureConfig(max_failures=0)
    decision, error = judged(
        state, FailureRecord(kind="process_death", rank=1, step=7, error="killed"), config
    )
    assert decision is Decision.RAISE
    assert "1 failure exceeds max_failures=0" in str(error)
    assert "killed" in str(error) and "before the reset" not in str(error)


def test_a_group_that_keeps_failing_to_start_ends_the_run_whatever_the_budget():
    state = RunState(name="r")
    config = FailureConfig(max_failures=-1)
    for i in range(knobs.START_FAILURE_LIMIT):
        failure = FailureRecord(kind="exception", rank=0, step=0, error=f"rendezvous {i}")
        decision, error = judged(state, failure, config, start_failures=i + 1)
    assert decision is Decision.RAISE
    assert f"failed to start {knobs.START_FAILURE_LIMIT} times in a row" in str(error)
    assert "GLOO_SOCKET_IFNAME" in str(error)
