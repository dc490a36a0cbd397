"""Drivers that start together on one run: exactly one takes its lease (the lease against real
processes and on S3 is in `tests/test_lease.py`)."""

from __future__ import annotations

import threading

from ft_train.errors import RunLockedError
from ft_train.storage.run_state import RunStore
from tests.conftest import on_storage
from tests.helpers import fresh, prepare_noop


@on_storage("local")
def test_of_drivers_that_start_together_exactly_one_takes_the_run(storage):
    plans, refused = [], []
    start = threading.Barrier(8)

    def contend():
        start.wait()
        try:
            plans.append(prepare_noop(storage, "raced"))
        except RunLockedError:
            refused.append(1)

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(plans), len(refused)) == (1, 7)
    assert RunStore(fresh(storage), "raced").load().driver_runs == 1
    plans[0].release()
