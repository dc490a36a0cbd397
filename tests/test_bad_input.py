"""Bad input: each case fails with an error that names the field or file and the fix, before any
rank starts where the driver can tell, with the run's stored state unchanged, and without spending
a retry that cannot help (a ConfigError, StorageError or SessionError, never an AttemptFailed;
a contract broken inside a rank ends the run at once, even with max_failures=3).

Most cases fail before a cluster starts (the flow's parameters are checked before Prefect starts a
flow run); the few that must run ranks use tiny loops from `tests.loops` on a local cluster.
`tests/unit/test_config.py` covers the config models on their own; here they come through the flow,
as a deployment's parameters or a Python call's would.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest

import ft_train
from ft_train.config import CheckpointConfig
from ft_train.errors import AttemptFailed, CheckpointDamagedError
from ft_train.storage.checkpoint import MANIFEST
from ft_train.storage.checkpoint_manager import CheckpointManager
from ft_train.storage.fs import Storage
from ft_train.storage.run_state import STATE_FILE, RunState, RunStore
from tests.conftest import StorageTarget, make_s3_target, moto_checks_credentials
from tests.helpers import fresh, load_state

pytestmark = pytest.mark.usefixtures("prefect_api")

LOOP = "tests.loops:report_many"
NAME_FIX = "unique_run_id=da823d5"  # the example of a valid name that the error gives


@pytest.fixture
def local(tmp_path) -> StorageTarget:
    return StorageTarget("local", str(tmp_path / "runs"))


def tree(target: StorageTarget) -> dict[str, bytes]:
    """Every file under a storage target's root, with its bytes ({} when there is nothing)."""
    st = fresh(target)
    root = st.full("")
    if st.is_local:
        found = {}
        for dirpath, _, names in os.walk(root):
            for n in names:
                path = os.path.join(dirpath, n)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, root)] = f.read()
        return found
    if not st.fs.exists(root.split("/")[0]):
        return {}
    st.fs.invalidate_cache()
    return {p: st.fs.cat_file(p) for p in st.fs.find(root)}


def train(target: StorageTarget, name: str = "bad-input", train_loop=LOOP, max_failures=3, **kw):
    """The flow, called as a user would; `run_config` in `kw` replaces the default one."""
    from flows.train import train as flow

    run_config = kw.pop("run_config", None) or ft_train.RunConfig(
        name=name,
        storage_path=target.path,
        storage_options=target.options,
        failure_config=ft_train.FailureConfig(max_failures=max_failures),
    )
    return flow(train_loop=train_loop, run_config=run_config, **kw)


@contextlib.contextmanager
def refused(error: type[BaseException], *words: str, target: StorageTarget):
    """The block raises `error` (a class no retry is spent on), its message holds each of
    `words` (the field or file, and the fix), and the storage under `target` is unchanged."""
    before, existed = tree(target), target.kind == "local" and os.path.exists(target.path)
    with pytest.raises(error) as err:
        yield err
    assert not isinstance(err.value, (AttemptFailed, ft_train.WorkerGroupError))
    if target.kind == "local":
        assert os.path.exists(target.path) == existed  # not even an empty directory
    message = str(err.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert tree(target) == before


# -- run names: one directory under storage_path ------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param("/", id="slash"),
        pytest.param("..", id="dotdot"),
        pytest.param("run\x1b[31mred", id="control-character"),
        pytest.param("r" * 201, id="over-200-characters"),
    ],
)
def test_a_bad_run_name_is_refused_before_anything_starts(local, name):
    """As a deployment passes it: a dict. Refused before a flow run, a cluster or storage."""
    run_config = {"name": name, "storage_path": local.path}
    with refused(ft_train.ConfigError, "run_config.name", NAME_FIX, "'..'", target=local):
        train(local, run_config=run_config)


# -- configs, as flow parameters ------------------------------------------------------------------


def run_dict(local, **fields) -> dict:
    return {"name": "cfg", "storage_path": local.path, **fields}


@pytest.mark.parametrize(
    "params, words",
    [
        pytest.param(
            {"run_config": {"max_failures": 3}},
            ["run_config.max_failures", "no such setting", "run_config.failure_config"],
            id="misplaced-field",
        ),
        pytest.param(
            {"scaling_config": {"num_worker": 2}},
            ["scaling_config.num_worker", "no such setting", "spelling"],
            id="misspelt-field",
        ),
        pytest.param(
            {"num_workers": 2},
            ["num_workers", "train_loop, run_config, train_loop_config, scaling_config, cluster"],
            id="unknown-flow-parameter",
        ),
        pytest.param(
            {"run_config": {"failure_config": {"max_failures": "three"}}},
            ["run_config.failure_config.max_failures", "valid integer", "-1 = unlimited"],
            id="max_failures-a-string",
        ),
        pytest.param(
            {"scaling_config": {"num_workers": "four"}},
            ["scaling_config.num_workers", "valid integer", "(min, max)"],
            id="num_workers-a-string",
        ),
        pytest.param(
            {"train_loop_config": [1, 2]},
            ["train_loop_config must be a dict", "not a list", "{'epochs': 10}"],
            id="train_loop_config-a-list",
        ),
        pytest.param(
            {"train_loop_config": {"lr": float("nan")}},
            ["train_loop_config must be JSON", "NaN", "as a string"],
            id="train_loop_config-nan",
        ),
        pytest.param(
            {"run_config": {"failure_config": {"max_failures": -2}}},
            [
                "run_config.failure_config.max_failures",
                "greater than or equal to -1",
                "-1 = unlimited",
            ],
            id="max_failures=-2",
        ),
        pytest.param(
            {"scaling_config": {"num_workers": 0}},
            ["scaling_config.num_workers", "give a number >= 1"],
            id="num_workers=0",
        ),
        pytest.param(
            {"run_config": {"checkpoint_config": {"num_to_keep": 0}}},
            ["run_config.checkpoint_config.num_to_keep", "None keeps all"],
            id="num_to_keep=0",
        ),
        pytest.param(
            {"scaling_config": {"num_workers": [3, 2]}},
            ["scaling_config.num_workers", "1 <= min <= max"],
            id="num_workers-min-over-max",
        ),
        pytest.param(
            {"scaling_config": {"num_workers": 2, "resources_per_worker": {"GPU": 1}}},
            ["scaling_config", "ray.train.ScalingConfig.resources_per_worker", "--resources"],
            id="ray-resources_per_worker",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_it_and_the_fix(local, params, words):
    """Unknown settings (a typo must not fall back to a default), wrong types, values out of
    range: refused before a flow run, a cluster or the storage is touched."""
    params = {**params, "run_config": run_dict(local, **params.get("run_config", {}))}
    with refused(ft_train.ConfigError, *words, target=local):
        train(local, **params)


def test_storage_options_of_the_wrong_type_are_refused_without_echoing_them(local):
    secret = "hunter2-not-to-be-shown"
    run_config = run_dict(local, storage_options=f"key=AKIA,secret={secret}")
    with refused(
        ft_train.ConfigError, "run_config.storage_options", "valid dictionary", target=local
    ) as err:
        train(local, run_config=run_config)
    assert secret not in str(err.value)


# -- storage ----------------------------------------------------------------------------------------


def test_a_missing_bucket_is_refused_naming_it(s3_endpoint):
    target = make_s3_target(s3_endpoint)
    missing = StorageTarget("s3", "s3://ft-no-such-bucket/runs", target.options)
    with refused(
        ft_train.StorageError,
        "run_config.storage_path",
        "'ft-no-such-bucket' does not exist",
        "create it",
        target=missing,
    ):
        train(missing)
    assert tree(missing) == {}


def test_wrong_s3_credentials_are_refused_naming_storage_options(s3_endpoint):
    target = make_s3_target(s3_endpoint)
    fresh(target).write_atomic("other/run_state.json", b"{}")  # something there already
    before = tree(target)
    wrong = StorageTarget("s3", target.path, {**target.options, "secret": "wrong-secret"})
    with moto_checks_credentials(), pytest.raises(ft_train.StorageError) as err:
        train(wrong)
    message = str(err.value)
    assert "run_config.storage_options" in message and "credentials" in message, message
    assert "wrong-secret" not in message
    assert tree(target) == before


def test_an_unwritable_local_path_is_refused():
    """/sys: unwritable whoever runs the test (root may write to a read-only directory)."""
    target = StorageTarget("local", "/sys/ft-train-runs")
    with refused(ft_train.StorageError, "/sys", "run_config.storage_path", target=target) as err:
        train(target)
    assert "write" in str(err.value) or "permission" in str(err.value).lower()


def test_a_storage_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "results.txt"
    path.write_text("not a directory")
    target = StorageTarget("local", str(path))
    with refused(
        ft_train.StorageError,
        "run_config.storage_path",
        str(path),
        "is a file, not a directory",
        "give a directory",
        target=target,
    ):
        train(target)
    assert path.read_text() == "not a directory"


# -- train_loop -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "train_loop, words",
    [
        pytest.param(
            "tests.loops:no_such_function",
            [
                "'tests.loops:no_such_function'",
                "has no 'no_such_function'",
                "check the name after the ':'",
            ],
            id="no-such-name",
        ),
        pytest.param(
            "tests.loops.report_many",
            ["'tests.loops.report_many'", "'package.module:function'"],
            id="no-colon",
        ),
        pytest.param(
            "tests.loops:os",
            [
                "'tests.loops:os'",
                "is a module, not a function",
                "give the training function's name",
            ],
            id="not-callable",
        ),
        pytest.param(42, ["train_loop 42", "'package.module:function'"], id="not-a-path"),
        pytest.param(
            "tests.loops:two_args",
            ["'tests.loops:two_args'", "(config, extra)", "def train_fn(config):"],
            id="two-required-args",
        ),
    ],
)
def test_a_train_loop_that_no_rank_could_call_is_refused_before_anything_starts(
    local, train_loop, words
):
    with refused(ft_train.TrainLoopImportError, *words, target=local):
        train(local, train_loop=train_loop)


# -- stored documents -----------------------------------------------------------------------------


def stored(local: StorageTarget, name: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        fresh(local).write_atomic(f"{name}/{rel}", data)


@pytest.mark.parametrize(
    "document, words",
    [
        pytest.param(
            b'{"name": "stored", "status": "runn',
            ["run_state.json", "not valid JSON", "restore the file", "another run_config.name"],
            id="corrupt-run-state",
        ),
        pytest.param(
            json.dumps({"schema_version": 99, "name": "stored"}).encode(),
            ["run_state.json", "schema_version 99", "upgrade ft-train"],
            id="newer-schema-version",
        ),
        pytest.param(b'["a list"]', ["run_state.json", "not a run state"], id="not-an-object"),
    ],
)
def test_a_run_state_that_cannot_be_resumed_is_refused_untouched(local, document, words):
    """Refused before the run's lease is taken: not a byte of the run directory changes."""
    stored(local, "stored", {STATE_FILE: document})
    with refused(ft_train.StorageError, *words, target=local):
        train(local, name="stored")


def test_a_run_directory_written_by_something_else_is_refused_untouched(local):
    stored(local, "theirs", {"model.pt": b"someone's weights", "notes/readme.txt": b"hello"})
    with refused(
        ft_train.StorageError,
        "model.pt",
        "notes",
        f"no {STATE_FILE}",
        "another run_config.name",
        "move those files away",
        target=local,
    ):
        train(local, name="theirs")


def committed_checkpoint(target: StorageTarget, name: str, tmp_path) -> ft_train.Checkpoint:
    """A run with one committed checkpoint, made as the driver commits one (no ranks)."""
    st = fresh(target)
    store = RunStore(st, name)
    state = RunState(name=name, status="finished")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "weights.pt").write_bytes(b"weights")
    files = st.upload_dir(str(tmp_path / "saved"), f"{name}/checkpoint_000001-a0-00000000")
    CheckpointManager(st, store, CheckpointConfig()).commit(
        state, "checkpoint_000001-a0-00000000", 1, {"loss": 0.5}, files, 0
    )
    return ft_train.TrainResult.from_path(target.path, name, target.options).checkpoint


@pytest.mark.parametrize("entry", ["../run_state.json", "/etc/hostname", "a/../../x"])
def test_a_manifest_entry_outside_its_checkpoint_is_never_followed(storage, tmp_path, entry):
    ckpt = committed_checkpoint(storage, "escape", tmp_path)
    manifest = ckpt.manifest()
    manifest["files"][entry] = manifest["files"]["weights.pt"]
    st = Storage(ckpt.path, storage.options)
    st.write_atomic(MANIFEST, json.dumps(manifest).encode())
    dst = tmp_path / "restore" / "here"
    with refused(
        CheckpointDamagedError,
        MANIFEST,
        repr(entry),
        "outside the checkpoint",
        "delete the checkpoint",
        target=storage,
    ):
        ckpt.to_directory(str(dst))
    assert not (tmp_path / "restore" / "run_state.json").exists()
    assert not (tmp_path / "x").exists()


# -- the cluster --------------------------------------------------------------------------------


def test_a_scheduler_that_is_not_there_is_refused_before_storage_is_touched(local):
    import dask

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
        with refused(
            ft_train.ConfigError,
            f"cluster.address {address!r}",
            "within 2s",
            "check the address",
            target=local,
        ):
            train(local, cluster=ft_train.ClusterConfig(address=address))


def test_more_ranks_than_a_fixed_local_cluster_has_fail_at_once(local):
    with refused(
        ft_train.ConfigError,
        "scaling_config.num_workers=3",
        "cluster.n_workers=2",
        "raise cluster.n_workers",
        target=local,
    ):
        train(
            local,
            scaling_config=ft_train.ScalingConfig(num_workers=3),
            cluster=ft_train.ClusterConfig(n_workers=2),
        )


def test_more_ranks_than_an_existing_cluster_has_time_out_naming_the_setting(local):
    """An existing cluster may grow, so the run waits for workers, then says what to change."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster:
        with pytest.raises(ft_train.WorkerStartupError) as err:
            train(
                local,
                scaling_config=ft_train.ScalingConfig(num_workers=2, worker_start_timeout_s=1),
                cluster=ft_train.ClusterConfig(address=cluster.scheduler_address),
            )
    assert "only 1 of 2 Dask workers" in str(err.value)
    assert "scaling_config.worker_start_timeout_s" in str(err.value)
    state = load_state(local, "bad-input")
    assert not any(f.charged for f in state.failures), state.failures


# -- inside a rank: a broken contract ends the run at once, whatever max_failures allows ---------


def failed_at_once(local: StorageTarget, name: str, error: str) -> None:
    state = load_state(local, name)
    assert state.status == "failed" and len(state.attempts) == 1, state
    assert not any(f.charged for f in state.failures), state.failures
    assert error in (state.error or ""), state.error


@pytest.mark.parametrize(
    "case, words",
    [
        pytest.param(
            "not_json",
            ["metrics must be JSON-serialisable", "object", "loss.item(), not the tensor"],
            id="metrics-not-json",
        ),
        pytest.param(
            "missing_dir",
            ["never-saved", "no such directory", "save the checkpoint's files into a directory"],
            id="checkpoint-dir-missing",
        ),
        pytest.param(
            "empty_dir",
            ["holds no files on any rank", "save the checkpoint's files into it"],
            id="checkpoint-dir-empty",
        ),
    ],
)
def test_a_report_that_breaks_its_contract_fails_the_run_at_once(local, case, words):
    with pytest.raises(ft_train.SessionError) as err:
        train(
            local,
            name=case.replace("_", "-"),
            train_loop="tests.loops:bad_report",
            train_loop_config={"case": case},
        )
    for word in words:
        assert word in str(err.value), str(err.value)
    failed_at_once(local, case.replace("_", "-"), words[0])


def test_ranks_reporting_unequally_fail_with_a_clear_error_not_a_deadlock(local):
    """Rank 0 returns after one report while rank 1 makes twenty: the agreements that report()
    starts only every few reports still find it (no collective waits for rank 0 forever)."""
    with pytest.raises(ft_train.SessionError, match="same number of times"):
        train(
            local,
            name="unequal",
            train_loop="tests.loops:report_counts",
            train_loop_config={"counts": [1, 20]},
            scaling_config=ft_train.ScalingConfig(num_workers=2),
        )
    failed_at_once(local, "unequal", "same number of times")


def test_nan_and_infinite_metrics_are_stored_as_strings_that_read_back(local):
    """A diverged loss is reported, not refused (the run goes on, and its checkpoint is kept);
    JSON has no NaN, so the stored documents say 'nan', 'inf', '-inf', at any depth."""
    result = train(local, name="diverged", train_loop="tests.loops:non_finite_metrics")
    expected = {
        "loss": "nan",
        "grad_norm": "inf",
        "per_class": [0.5, "-inf"],
        "nested": {"x": "nan"},
    }
    assert result.status == "finished"
    assert json.loads(json.dumps(result.last_metrics)) == expected  # lists come back as tuples

    def strict(raw: bytes):
        return json.loads(raw, parse_constant=lambda c: pytest.fail(f"{c} in stored JSON"))

    st = fresh(local)
    state = strict(st.read_bytes(f"diverged/{STATE_FILE}"))
    assert state["checkpoints"][0]["metrics"] == expected
    manifest = strict(st.read_bytes(f"diverged/{state['latest']}/{MANIFEST}"))
    assert manifest["metrics"] == expected
    assert ft_train.TrainResult.from_path(local.path, "diverged").last_metrics == expected
