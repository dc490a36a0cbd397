"""The S3 endpoint goes down while a run uses it (`tests/outage.py`: its port refuses, its open
connections are reset), at the moment of a chosen write: a checkpoint file's upload by a rank,
the driver's write of the run state, the renewal of the driver's lease.

- Down for 5 s: botocore's retries (`knobs.S3_RETRY_ATTEMPTS`, set by `Storage`) ride it out;
  the run finishes with no failure recorded, and the write that was cut is stored.
- Down past the retries: a rank's upload fails its group (one charged failure) and the run
  restores from the checkpoint before once storage is back; the driver waits for storage while
  its lease holds, and past that it stops, and the next flow run resumes from the latest
  committed checkpoint.
"""

from __future__ import annotations

import re

import pytest

import ft_train
from ft_train import knobs
from tests.conftest import StorageTarget, make_s3_target
from tests.helpers import demo_config, load_state, train_demo
from tests.outage import FlakyEndpoint

pytestmark = pytest.mark.usefixtures("prefect_api")

CHECKPOINT_FILE = rb"PUT /[^ ]*/(checkpoint_[^/ ]+)/train_state\.pt"
RUN_STATE = rb"PUT /[^ ]*/run_state\.json"
LEASE = rb"PUT /[^ ]*/driver_lease\.json"
# a budget of 2 attempts (about 1 s), so that a short outage outlasts it
FEW_RETRIES = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 2}}}


@pytest.fixture
def flaky(s3_endpoint):
    endpoint = FlakyEndpoint(s3_endpoint)
    yield endpoint
    endpoint.close()


def through(flaky: FlakyEndpoint, **options) -> StorageTarget:
    """A fresh bucket, reached through the endpoint that goes down."""
    target = make_s3_target(flaky.url)
    return StorageTarget("s3", target.path, {**target.options, **options})


def outage_s(flaky: FlakyEndpoint) -> float:
    assert flaky.hit is not None, "the outage never happened: nothing matched"
    (down, up), *_ = flaky.outages
    assert up > 0, "still down"
    return up - down


@pytest.mark.parametrize(
    "what, pattern, nth",
    [("checkpoint-upload", CHECKPOINT_FILE, 2), ("run-state", RUN_STATE, 4), ("lease", LEASE, 2)],
)
def test_an_outage_of_5s_is_ridden_out_with_no_failure(flaky, monkeypatch, what, pattern, nth):
    """The lease's ttl is 12 s here (renewed every 2 s): its second write is a renewal."""
    monkeypatch.setattr(knobs, "LEASE_TTL_S", 12.0)
    storage = through(flaky)
    flaky.down_on(pattern, 5.0, nth=nth)
    result = train_demo(storage, f"ride-{what}", demo_config(), max_failures=0)
    assert outage_s(flaky) >= 5.0
    assert result.status == "finished"
    state = load_state(storage, f"ride-{what}")
    assert state.failures == [] and len(state.attempts) == 1, state.failures
    if what == "checkpoint-upload":  # the upload that was cut was stored, and committed
        cut = re.search(CHECKPOINT_FILE, flaky.hit).group(1).decode()
        assert cut in [c.dir_name for c in state.checkpoints], (cut, state.checkpoints)


def test_an_upload_past_its_retries_fails_once_and_the_run_resumes(flaky):
    storage = through(flaky, **FEW_RETRIES)
    flaky.down_on(CHECKPOINT_FILE, 6.0, nth=2)
    result = train_demo(storage, "upload-down", demo_config(), max_failures=1)
    assert outage_s(flaky) >= 6.0
    assert result.status == "finished"
    state = load_state(storage, "upload-down")
    (failure,) = state.failures
    assert failure.charged and failure.kind == "exception", failure
    assert "StorageError" in failure.error or "connect" in failure.error.lower(), failure.error
    first = state.checkpoints[0].dir_name
    cut = re.search(CHECKPOINT_FILE, flaky.hit).group(1).decode()
    assert state.attempts[1].restored_from == first != cut  # the one before the cut upload
    assert cut not in [c.dir_name for c in state.checkpoints]


@pytest.mark.parametrize("what, pattern, nth", [("run-state", RUN_STATE, 4), ("lease", LEASE, 2)])
def test_a_driver_cut_off_past_its_lease_stops_and_the_next_run_resumes(
    flaky, monkeypatch, what, pattern, nth
):
    """Storage down for longer than the lease's ttl (4 s here): the driver waits for it while
    the lease holds, then stops, saying why; rerun once storage is back, the run resumes from
    its latest committed checkpoint, with the stop recorded (not charged)."""
    monkeypatch.setattr(knobs, "LEASE_TTL_S", 4.0)
    storage = through(flaky, **FEW_RETRIES)
    name = f"cut-off-{what}"
    flaky.down_on(pattern, 10.0, nth=nth)
    config = demo_config(epochs=2)
    with pytest.raises(ft_train.errors.FtTrainError, match="lost the lease"):
        train_demo(storage, name, config, max_failures=0)
    flaky.wait_up()
    before = load_state(storage, name)  # read once storage is back: the outage has ended
    assert outage_s(flaky) >= 10.0

    result = train_demo(storage, name, config, max_failures=0)
    assert result.status == "finished"
    state = load_state(storage, name)
    assert state.attempts[-1].restored_from == before.latest
    assert [f.kind for f in state.failures] == ["driver_crash"] and not state.failures[0].charged
