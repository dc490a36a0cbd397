"""`RunConfig.resume` ("auto", "never", "must") and the config a run is resumed with
(`ft_train.driver.resume`): on a local path and on S3, through `prepare_run` (what a flow run does
first). Through the flow, with its ranks: `test_worker_failures`' rerun of a failed run."""

import pytest

import ft_train
from ft_train import driver
from ft_train.errors import ConfigError
from ft_train.storage.run_state import STATE_FILE, RunStore
from tests.conftest import on_storage
from tests.helpers import fresh, load_state


def noop_train_loop(config):
    """An importable train_loop for `prepare_run`; never called."""


def other_train_loop(config):
    """Another one."""


def prepare(
    target, name, resume="auto", config=None, workers=1, keep=None, loop="noop_train_loop", log=None
) -> driver.RunPlan:
    return driver.prepare_run(
        f"{__name__}:{loop}",
        config or {},
        ft_train.ScalingConfig(num_workers=workers),
        ft_train.RunConfig(
            name=name,
            storage_path=target.path,
            storage_options=target.options,
            checkpoint_config=ft_train.CheckpointConfig(num_to_keep=keep),
            resume=resume,
        ),
        log=(lambda msg: None) if log is None else log.append,
    )


def files(target, name) -> dict[str, bytes]:
    """Every file stored under run `name`, with its bytes."""
    storage = fresh(target)
    root = storage.full(name)
    return {path: storage.fs.cat_file(path) for path in storage.fs.find(root)}


def started(target, name, **kw) -> None:
    """A run that exists and is not finished: a driver started it and ended."""
    prepare(target, name, **kw).release()


def test_never_refuses_a_run_that_exists_and_writes_nothing(storage):
    started(storage, "taken")
    before = files(storage, "taken")
    with pytest.raises(
        ConfigError, match="run_config.resume='never': run 'taken' already exists"
    ) as e:
        prepare(storage, "taken", resume="never")
    assert "use another run_config.name" in str(e.value)  # the fix
    assert files(storage, "taken") == before  # not even the lease was touched
    plan = prepare(storage, "new", resume="never")  # a new name starts
    assert plan.state.driver_runs == 1
    plan.release()


def test_must_refuses_a_run_that_does_not_exist_and_creates_nothing(storage):
    with pytest.raises(
        ConfigError, match="resume='must': there is no run 'typo' at .* to resume"
    ) as e:
        prepare(storage, "typo", resume="must")
    assert "check run_config.name and run_config.storage_path" in str(e.value)
    assert files(storage, "typo") == {}  # no run directory, no lease left behind


def test_must_refuses_a_changed_training_config_naming_each_change(storage):
    started(storage, "run", config={"lr": 0.1, "faults": [{"rank": 1, "step": 7}]})
    before = files(storage, "run")
    with pytest.raises(ConfigError, match="differs from the one run 'run' last trained with") as e:
        prepare(storage, "run", resume="must", config={"lr": 0.01, "epochs": 3})
    message = str(e.value)
    assert "train_loop_config.lr: 0.1 -> 0.01" in message
    assert 'train_loop_config.faults: [{"rank": 1, "step": 7}] -> (removed)' in message
    assert "train_loop_config.epochs: (absent) -> 3" in message
    assert "resume='auto' to resume with the new ones" in message  # the fix
    with pytest.raises(
        ConfigError,
        match=r'train_loop: "tests.test_resume:noop_train_loop" -> '
        r'"tests.test_resume:other_train_loop"',
    ):
        prepare(
            storage,
            "run",
            resume="must",
            config={"lr": 0.1, "faults": [{"rank": 1, "step": 7}]},
            loop="other_train_loop",
        )
    assert files(storage, "run") == before


@on_storage("local")
def test_must_resumes_the_same_training_config_on_other_settings_and_says_which(storage):
    started(storage, "run", config={"lr": 0.1}, workers=2)
    log = []
    plan = prepare(storage, "run", resume="must", config={"lr": 0.1}, workers=1, keep=2, log=log)
    assert plan.state.driver_runs == 2
    changed = [m for m in log if "resumes with changed settings" in m]
    assert len(changed) == 1, log
    assert "scaling_config.num_workers: 2 -> 1" in changed[0]
    assert "checkpoint_config.num_to_keep: null -> 2" in changed[0]
    assert not any("warning" in m for m in log), log
    plan.release()


@on_storage("s3")
def test_auto_resumes_a_changed_config_says_what_changed_and_records_it(storage):
    started(storage, "run", config={"lr": 0.1})
    log = []
    prepare(storage, "run", config={"lr": 0.01}, log=log).release()
    assert (
        "warning: run 'run' resumes with a changed config: train_loop_config.lr: 0.1 -> 0.01" in log
    )
    assert load_state(storage, "run").config["train_loop_config"] == {"lr": 0.01}
    # the config it last trained with is the new one: `must` now resumes that one alone
    prepare(storage, "run", resume="must", config={"lr": 0.01}).release()
    with pytest.raises(ConfigError, match="lr: 0.01 -> 0.1"):
        prepare(storage, "run", resume="must", config={"lr": 0.1})


@on_storage("local")
def test_a_run_stored_without_its_config_is_compared_by_its_fingerprint(storage):
    """A run state written before `RunState.config` existed records only a fingerprint."""
    started(storage, "old", config={"lr": 0.1})
    store = RunStore(fresh(storage), "old")
    state = store.load()
    state.config = None
    fresh(storage).write_atomic(
        f"old/{STATE_FILE}", state.model_dump_json(exclude={"config"}).encode()
    )
    with pytest.raises(ConfigError, match="stored by an ft-train that recorded no more"):
        prepare(storage, "old", resume="must", config={"lr": 0.2})
    plan = prepare(storage, "old", resume="must", config={"lr": 0.1})  # the same fingerprint
    assert plan.state.config["train_loop_config"] == {"lr": 0.1}  # recorded from now on
    plan.release()


@on_storage("local")
def test_a_finished_run_is_returned_under_must_and_refused_under_never(storage):
    plan = prepare(storage, "done", config={"lr": 0.1})
    plan.state.status = "finished"
    plan.store.save(plan.state)
    plan.release()
    again = prepare(storage, "done", resume="must", config={"lr": 0.5})  # nothing will train
    assert again.finished
    with pytest.raises(ConfigError, match="already exists at .* \\(finished"):
        prepare(storage, "done", resume="never")


def test_resume_is_a_flow_parameter_with_its_choices():
    from flows.train import train

    schema = train.parameters.model_dump()["definitions"]["RunConfig"]["properties"]["resume"]
    assert schema["enum"] == ["auto", "never", "must"] and schema["default"] == "auto"
    with pytest.raises(ValueError, match="resume"):
        ft_train.RunConfig(name="x", resume="always")
