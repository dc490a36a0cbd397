"""What a run shows in Prefect (`tasks/publish.py`): events as it trains, artifacts at its end,
read back from the session's Prefect API."""

import contextvars
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.context import TaskRunContext

import ft_train
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.fs import Storage
from ft_train.storage.metric_history import history_path
from ft_train.storage.run_state import RunStore
from tasks.publish import artifact_key
from tests.conftest import on_storage
from tests.helpers import demo_config, events_of, fault, fresh, load_state, train_demo, wait_for

pytestmark = pytest.mark.usefixtures("prefect_api")


def artifacts_of(name: str, what: str) -> list:
    """Every version of the run's artifact `what`, oldest first."""
    with get_client(sync_client=True) as client:
        newest_first = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(name, what)])),
            sort=ArtifactSort.CREATED_DESC,
        )
    return newest_first[::-1]


@on_storage("local")
def test_a_run_sends_its_failures_and_checkpoints_as_events_and_ends_with_artifacts(
    storage, tmp_path
):
    """A run fails (a rank raises, no retries left), then a rerun finishes it: each failure and
    checkpoint is an event of the run, sent while the run trains, each end is one too, and each
    flow run leaves tables of the run's checkpoints and failures."""
    name, gate = "published", tmp_path / "go-on"
    config = demo_config(
        [
            fault(tmp_path, 1, 7),  # the first flow run fails here
            {"rank": 0, "step": 11, "kind": "until_file", "path": str(gate)},
        ]
    )
    with pytest.raises(ft_train.TrainingFailedError):
        train_demo(storage, name, config)
    failed = load_state(storage, name)
    with ThreadPoolExecutor(1) as pool:  # the rerun, in the test's Prefect settings
        rerun = pool.submit(contextvars.copy_context().run, train_demo, storage, name, config)
        try:
            wait_for(
                lambda: (
                    rerun.done()
                    or any(
                        e.payload.get("step") == 10
                        for e in events_of(name)
                        if e.event == "ft-train.checkpoint.committed"
                    )
                ),
                60,
                "the step-10 checkpoint's event while the run is held at step 11",
            )
            assert not rerun.done(), rerun.exception()
        finally:
            gate.touch()  # never leave the rerun held
        result = rerun.result(timeout=120)
    assert result.status == "finished"
    state = load_state(storage, name)

    wait_for(
        lambda: any(e.event == "ft-train.run.finished" for e in events_of(name)),
        30,
        "the run's events to be stored",
    )
    events = events_of(name)
    names = [e.event for e in events]
    committed = [e for e in events if e.event == "ft-train.checkpoint.committed"]
    first_run = [e for e in names[: names.index("ft-train.run.failed") + 1]]
    assert first_run[-2:] == ["ft-train.failure", "ft-train.run.failed"], names
    assert first_run.count("ft-train.checkpoint.committed") == len(failed.checkpoints), names
    assert names[-1] == "ft-train.run.finished", names
    failure = events[names.index("ft-train.failure")]
    assert (failure.payload["kind"], failure.payload["rank"], failure.payload["step"]) == (
        "exception",
        1,
        7,
    )
    assert [e.payload["step"] for e in committed] == [c.report_index for c in state.checkpoints]
    assert committed[-1].payload["path"] == result.checkpoint.path
    assert "loss" in committed[-1].payload["metrics"]
    finished = events[-1].payload
    assert finished["status"] == "finished" and finished["step"] == state.report_index
    assert all(
        r.id.startswith("prefect.flow-run.")
        for e in events
        for r in e.related
        if r.role == "flow-run"
    )
    assert all(any(r.role == "flow-run" for r in e.related) for e in events), (
        "each event names its flow run"
    )

    checkpoints = artifacts_of(name, "checkpoints")
    assert len(checkpoints) == 2  # one version per flow run that ended
    rows = json.loads(checkpoints[-1].data)
    entries = RunStore(fresh(storage), name).all_checkpoints(state)
    assert [r["step"] for r in rows] == [e.report_index for e in entries]
    assert rows[-1]["checkpoint"] == result.checkpoint.path and "loss" in rows[-1]
    failures = json.loads(artifacts_of(name, "failures")[-1].data)
    assert [(f["kind"], f["rank"], f["step"]) for f in failures] == [("exception", 1, 7)]
    summaries = artifacts_of(name, "summary")
    assert "failed" in summaries[0].data and "finished" in summaries[-1].data


def reads_at_the_end(monkeypatch) -> Counter:
    """Counts, by path, what the finalize task reads from storage (the real reads still happen),
    and its listings of the whole checkpoint index (`all_checkpoints()`)."""
    reads: Counter = Counter()

    def at_the_end() -> bool:
        context = TaskRunContext.get()
        return context is not None and context.task.name == "finalize"

    read_bytes, all_checkpoints = Storage.read_bytes, RunStore.all_checkpoints

    def read(self, path):
        reads[path] += at_the_end()
        return read_bytes(self, path)

    def listed(self, state):
        reads["all_checkpoints()"] += at_the_end()
        return all_checkpoints(self, state)

    monkeypatch.setattr(Storage, "read_bytes", read)
    monkeypatch.setattr(RunStore, "all_checkpoints", listed)
    return reads


@on_storage("local")
def test_the_end_of_a_run_reads_its_checkpoints_and_history_once(storage, monkeypatch):
    """A run trains to its end, then a rerun returns the finished result. The first end lists the
    checkpoint index once (each sealed chunk one read) and reads no history (the driver kept it
    as it trained); the rerun's reads each once: the result, the artifacts and the live view
    share what was read."""
    monkeypatch.setattr(CheckpointManager.__init__, "__defaults__", (1,))  # a chunk per commit
    name = "read-once"
    reads = reads_at_the_end(monkeypatch)
    result = train_demo(storage, name, demo_config())
    state = load_state(storage, name)
    assert result.status == "finished" and state.sealed_chunks >= 1, state
    chunks = [RunStore(fresh(storage), name).chunk_path(i) for i in range(state.sealed_chunks)]
    assert reads == Counter({"all_checkpoints()": 1, **dict.fromkeys(chunks, 1)}), reads

    reads.clear()
    again = train_demo(storage, name, demo_config())
    assert reads == Counter(
        {"all_checkpoints()": 1, history_path(name): 1, **dict.fromkeys(chunks, 1)}
    ), reads
    assert again.metrics_history == result.metrics_history and again.metrics_history
    assert [c.path for c, _ in again.best_checkpoints] == [
        c.path for c, _ in result.best_checkpoints
    ]
    entries = RunStore(fresh(storage), name).all_checkpoints(state)
    rows = json.loads(artifacts_of(name, "checkpoints")[-1].data)
    assert [r["step"] for r in rows] == [e.report_index for e in entries], rows
    plotted = artifacts_of(name, "metrics")[-1].data
    assert len(json.loads(plotted)) == len(again.metrics_history), "the live view's history too"
