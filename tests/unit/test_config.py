"""Configs, the public API surface and the exception tree: pure unit tests, no storage, no cluster.

The configs are the Prefect flow's parameters, so what they accept and refuse (and the message a
user reads when refused) is part of the contract.
"""

from __future__ import annotations

import inspect
import os
import pickle

import pytest
from pydantic import ValidationError

import ft_train
from ft_train import errors
from ft_train.config import (
    CheckpointConfig,
    ClusterConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
)
from ft_train.storage.fs import Storage

# -- RunConfig.name: one directory under storage_path ----------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a/b",
        "../escape",
        "..",
        "a..b",
        "run\x00x",
        "run\tx",
        "run\nx",
        pytest.param("run\n", id="trailing-newline"),
        "",
        ".hidden",
        "-flag",
        " padded",
        "a" * 201,
    ],
)
def test_bad_run_names_are_refused_with_the_field_and_the_fix(name):
    with pytest.raises(ValidationError) as err:
        RunConfig(name=name, storage_path="/tmp/runs")
    message = str(err.value)
    assert "run_config.name" in message
    assert "unique_run_id=da823d5" in message  # an example of a valid name: the fix
    assert "'/'" in message and "'..'" in message  # what is not allowed, and why


@pytest.mark.parametrize("name", ["unique_run_id=da823d5", "a", "A" * 200, "exp-1.2_b+c,d@e:f"])
def test_good_run_names_are_accepted_unchanged(name):
    assert RunConfig(name=name, storage_path="/tmp/runs").name == name


def test_run_config_without_a_name_leaves_it_to_the_flow_run_but_must_resume_needs_one():
    """As in Ray, a RunConfig needs no name (the flow run generates one: tests/test_trainer.py);
    but resume='must' resumes a run by its name, and a generated name is always a new run's."""
    assert RunConfig().name is None
    with pytest.raises(ValidationError, match=r"resume='must'.*give the name of the run"):
        RunConfig(resume="must")


# -- storage_path and storage_options --------------------------------------------------------------


def test_relative_local_storage_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(name="r", storage_path="results/here")
    assert os.path.isabs(cfg.storage_path)
    assert cfg.storage_path == str(tmp_path / "results" / "here")


def test_home_in_local_storage_path_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert RunConfig(name="r", storage_path="~/runs").storage_path == str(tmp_path / "runs")


def test_default_storage_path_is_absolute_too(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert RunConfig(name="r").storage_path == str(tmp_path / "ft_train_results")


def test_url_storage_path_is_kept():
    cfg = RunConfig(name="r", storage_path="s3://bucket/prefix/")
    assert cfg.storage_path == "s3://bucket/prefix"
    assert RunConfig(name="r", storage_path="s3://bucket").storage_path == "s3://bucket"


def test_empty_storage_path_is_refused():
    with pytest.raises(ValidationError, match="run_config.storage_path"):
        RunConfig(name="r", storage_path="  ")


def test_storage_options_are_not_in_repr():
    secret = "hunter2-very-secret"
    cfg = RunConfig(
        name="r",
        storage_path="s3://bucket",
        storage_options={"key": "AKIA-visible-id", "secret": secret},
    )
    assert secret not in repr(cfg) and secret not in str(cfg)
    assert cfg.storage_options["secret"].get_secret_value() == secret  # hidden, not lost
    assert Storage(cfg.storage_path, cfg.storage_options).options["secret"] == secret  # fsspec's


# -- FailureConfig, CheckpointConfig, ScalingConfig, ClusterConfig ---------------------------------


@pytest.mark.parametrize("value", [-1, 0, 3])
def test_max_failures_accepts_unlimited_none_and_a_count(value):
    assert FailureConfig(max_failures=value).max_failures == value


def test_max_failures_default_is_no_retry():
    assert FailureConfig().max_failures == 0


@pytest.mark.parametrize("value", [-2, -100])
def test_max_failures_below_minus_one_is_refused(value):
    with pytest.raises(ValidationError, match="max_failures"):
        FailureConfig(max_failures=value)


def test_num_to_keep_zero_is_refused():
    with pytest.raises(ValidationError, match="num_to_keep"):
        CheckpointConfig(num_to_keep=0)
    assert CheckpointConfig(num_to_keep=1).num_to_keep == 1
    assert CheckpointConfig().num_to_keep is None  # keep all


@pytest.mark.parametrize("order", ["max", "min"])
def test_score_order_max_and_min(order):
    assert CheckpointConfig(checkpoint_score_order=order).checkpoint_score_order == order


@pytest.mark.parametrize("order", ["asc", "MAX", "", None])
def test_score_order_other_values_are_refused(order):
    with pytest.raises(ValidationError, match="checkpoint_score_order"):
        CheckpointConfig(checkpoint_score_order=order)


@pytest.mark.parametrize(
    "model, kwargs",
    [
        (RunConfig, {"name": "r", "storage_path": "/tmp/x", "stoarge_options": {}}),
        (FailureConfig, {"max_failure": 3}),
        (CheckpointConfig, {"num_to_kep": 2}),
        (ScalingConfig, {"num_worker": 2}),
        (ClusterConfig, {"adress": "tcp://h:8786"}),
    ],
)
def test_unknown_fields_are_refused(model, kwargs):
    """A typo must not silently fall back to a default."""
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model(**kwargs)


def test_configs_are_frozen():
    cfg = ScalingConfig(num_workers=2)
    with pytest.raises(ValidationError):
        cfg.num_workers = 3


def test_scaling_config_needs_a_worker():
    with pytest.raises(ValidationError, match="num_workers"):
        ScalingConfig(num_workers=0)


@pytest.mark.parametrize("address", ["8786", "host", "host:port", "a/b:1"])
def test_cluster_address_must_be_a_url(address):
    with pytest.raises(ValidationError) as err:
        ClusterConfig(address=address)
    assert "cluster.address" in str(err.value) and "tcp://" in str(err.value)


@pytest.mark.parametrize("address", [None, "tcp://10.0.0.1:8786", "tls://scheduler:8786"])
def test_cluster_address_urls_are_accepted(address):
    assert ClusterConfig(address=address).address == address


def test_a_bare_host_port_is_taken_as_tcp():
    assert ClusterConfig(address="localhost:8786").address == "tcp://localhost:8786"


@pytest.mark.parametrize(
    "preload, message",
    [
        (["sklearn datasets"], "cluster.preload[0] 'sklearn datasets' is not a module name"),
        (
            ["json", "no_such_package_ft.sub"],
            "cluster.preload[1] 'no_such_package_ft.sub': no package "
            "'no_such_package_ft' is installed here; install it",
        ),
    ],
)
def test_cluster_preload_names_installed_modules(preload, message):
    with pytest.raises(ValidationError, match=message.replace(".", r"\.").replace("[", r"\[")):
        ClusterConfig(preload=preload)


def test_cluster_preload_of_an_existing_cluster_is_not_looked_for_here():
    """Its workers may have packages the driver has not."""
    cfg = ClusterConfig(address="tcp://10.0.0.1:8786", preload=["no_such_package_ft"])
    assert cfg.preload == ("no_such_package_ft",)


def test_configs_round_trip_as_flow_parameters():
    """Prefect passes parameters as JSON: a dumped config validates back to an equal one."""
    cfg = RunConfig(
        name="unique_run_id=da823d5",
        storage_path="s3://bucket",
        storage_options={"endpoint_url": "http://127.0.0.1:5000"},
        failure_config=FailureConfig(max_failures=-1),
        checkpoint_config=CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min"
        ),
    )
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg


# -- the public API ------------------------------------------------------------------------------


DESIGN_API = {
    "get_context",
    "get_preemption_info",
    "get_checkpoint",
    "report",
    "Checkpoint",
    "ScalingConfig",
    "RunConfig",
    "FailureConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "TrainResult",
}

# Adding a public name is deliberate: change this list in the same commit.
PUBLIC_API = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ClusterConfig",
    "ConfigError",
    "FailureConfig",
    "FailureRecord",
    "FtTrainError",
    "PreemptionInfo",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "RunConfig",
    "RunLockedError",
    "ScalingConfig",
    "SessionError",
    "StorageError",
    "TrainContext",
    "TrainLoopImportError",
    "TrainResult",
    "TrainingFailedError",
    "UserCallback",
    "WorkerGroupError",
    "WorkerStartupError",
    "collective",
    "enable_jit_checkpoint",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_preemption_info",
    "report",
    "staging_dir",
]


def test_public_api_is_pinned():
    assert DESIGN_API <= set(ft_train.__all__)
    assert sorted(ft_train.__all__) == PUBLIC_API
    for name in ft_train.__all__:
        assert getattr(ft_train, name) is not None, name


def test_torch_helpers_exist():
    import ft_train.torch

    assert ft_train.torch is ft_train.__getattr__("torch")
    assert callable(ft_train.torch.prepare_model)
    assert callable(ft_train.torch.prepare_data_loader)


def test_worker_api_outside_a_training_function_says_where_it_works():
    with pytest.raises(ft_train.SessionError, match="inside a training function"):
        ft_train.get_context()
    with pytest.raises(ft_train.SessionError, match="inside a training function"):
        ft_train.report({"loss": 1.0})


# -- the exception tree ----------------------------------------------------------------------------

FAILURE = {"kind": "exception", "rank": 1, "step": 7, "error": "boom", "charged": True}

EXAMPLES = {
    "FtTrainError": ("something failed",),
    "ConfigError": ("train_loop_config must be JSON-serialisable",),
    "TrainLoopImportError": ("train_loop 'x:y': cannot import 'x'",),
    "StorageError": ("s3://b/r/run_state.json is not valid JSON",),
    "CheckpointDamagedError": ("s3://b/r/c/model.pt does not match its manifest", "s3://b/r/c"),
    "SessionError": ("report() takes a dict",),
    "AttemptFailed": ("rank 1 raised at step 7: boom", FAILURE),
    "WorkerGroupError": (
        "training failed: 2 failures exceed max_failures=1",
        {1: errors.RankError("ValueError: boom", "Traceback ...", 1, 7)},
        [FAILURE],
    ),
    "RankError": ("ValueError: boom", "Traceback (most recent call last): ...", 1, 7, "exception"),
    "WorkerStartupError": ("2 of 4 workers arrived in 120s",),
    "RunLockedError": ("run 'x' is being trained by another driver (pid 7 on node-1)",),
    "TrainingFailedError": ("training failed: 4 failures exceed max_failures=3", [FAILURE]),
    "RankFailure": (1, 7, "ValueError: boom", "Traceback (most recent call last): ..."),
}


def _exception_classes():
    return sorted(
        name
        for name, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    )


def test_every_exception_has_an_example():
    assert _exception_classes() == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_exceptions_survive_pickling(name):
    cls = getattr(errors, name)
    exc = cls(*EXAMPLES[name])
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc)
    assert back.args == exc.args
    assert vars(back) == vars(exc)  # failure, failures, rank, step, error, traceback


def test_exception_tree():
    for name in _exception_classes():
        if name != "RankFailure":  # plain data raised inside a Dask task, not to users
            assert issubclass(getattr(errors, name), errors.FtTrainError), name
    assert issubclass(errors.TrainLoopImportError, errors.ConfigError)
    assert issubclass(errors.ConfigError, ValueError)
    assert str(errors.AttemptFailed("rank 1 died", FAILURE)) == "rank 1 died"
    assert errors.AttemptFailed("rank 1 died", FAILURE).failure == FAILURE
    assert not issubclass(errors.AttemptFailed, errors.TrainingFailedError)  # retried, not final
    assert "AttemptFailed" not in ft_train.__all__  # the retry signal is internal
    assert errors.TrainingFailedError("failed").failures == []
    # Ray's: the final error of a budget spent on worker failures is a TrainingFailedError
    assert issubclass(errors.WorkerGroupError, errors.TrainingFailedError)
    lost = errors.RankError("worker tcp://w:1: process died", "", 0, 3, "process_death")
    spent = errors.WorkerGroupError("spent", {0: lost})
    assert str(spent) == "spent" and spent.worker_failures == {0: lost} and spent.failures == []
    assert lost.type_name == "" and str(lost) == "worker tcp://w:1: process died"
    assert errors.RankError("ValueError: boom").type_name == "ValueError"


@pytest.mark.parametrize("n", [0, (0, 2), (3, 2), -1])
def test_bad_num_workers_are_refused_naming_the_field(n):
    with pytest.raises(ValidationError, match="scaling_config.num_workers"):
        ScalingConfig(num_workers=n)


def test_elastic_num_workers_give_min_and_max():
    fixed, elastic = ScalingConfig(num_workers=3), ScalingConfig(num_workers=(1, 4))
    assert (fixed.min_workers, fixed.max_workers) == (3, 3)
    assert (elastic.min_workers, elastic.max_workers) == (1, 4)
