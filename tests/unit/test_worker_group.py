"""The controller's report rounds and its choice of the hung rank, without a worker group (the
group on a cluster is in `tests/test_worker_group.py`)."""

from __future__ import annotations

from ft_train.controller.rounds import ReportRounds
from ft_train.protocol import message


def test_rounds_complete_in_order_once_every_rank_reported():
    rounds = ReportRounds(world_size=2, last_index=4)
    rounds.add(
        message(
            {
                "rank": 1,
                "index": 5,
                "metrics": {"r": 1},
                "dir_name": "checkpoint_000005-a0-x",
                "files": {"b": {}},
            }
        )
    )
    rounds.add(message({"rank": 1, "index": 6, "metrics": {"r": 1}}))
    assert rounds.pop_complete() is None  # rank 0 has not reported round 5 yet
    rounds.add(message({"rank": 0, "index": 6, "metrics": {"r": 0}}))
    assert rounds.pop_complete() is None  # round 6 waits for round 5
    rounds.add(
        message(
            {
                "rank": 0,
                "index": 5,
                "metrics": {"r": 0},
                "dir_name": "checkpoint_000005-a0-x",
                "files": {"a": {}},
            }
        )
    )
    five = rounds.pop_complete()
    assert (five.index, five.metrics, sorted(five.files)) == (5, {"r": 0}, ["a", "b"])
    six = rounds.pop_complete()
    assert (six.index, six.dir_name) == (6, None)
    assert rounds.pop_complete() is None


def test_the_hung_rank_is_the_one_furthest_behind_even_if_never_heard_from():
    from ft_train.policy.attribution import hung_rank

    # rank 1 reported up to 10 and then timed out waiting for a peer (it is `waiting`); rank 0
    # froze before its first batch reached the driver, so nothing at all came from it
    assert hung_rank(range(2), {}, 1, {1: 10}, {1: 5.0}) == 0
    # of several running ranks: fewest reports, then heard from least recently
    assert hung_rank(range(3), {}, None, {0: 9, 1: 8, 2: 8}, {0: 3.0, 1: 2.0, 2: 1.0}) == 2
    # ranks that returned are not it; the waiting one is, when every other rank returned
    assert hung_rank(range(2), {0: {}}, None, {0: 9, 1: 10}, {0: 1.0, 1: 2.0}) == 1
    assert hung_rank(range(2), {0: {}}, 1, {0: 9, 1: 10}, {0: 1.0, 1: 2.0}) == 1
