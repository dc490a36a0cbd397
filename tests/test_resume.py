"""`RunConfig.resume` ("auto", "never", "must"), `RunConfig.allow_train_loop_change` and the config
a run is resumed with (`ft_train.driver.resume`): on a local path and on S3, through `prepare_run`
(what a flow run does first); through the flow, with its ranks, a finished demo run trained on
for another epoch. Also `test_worker_failures`' rerun of a failed run."""

import pytest

import ft_train
from ft_train.driver import prepare as driver
from ft_train.errors import ConfigError
from ft_train.storage.run_state import STATE_FILE, RunStore
from tests.conftest import on_storage
from tests.helpers import DEMO, demo_config, fresh, load_state, run_config, train_demo


def noop_train_loop(config):
    """An importable train_loop for `prepare_run`; never called."""


def other_train_loop(config):
    """Another one."""


def prepare(
    target,
    name,
    resume="auto",
    config=None,
    workers=1,
    keep=None,
    loop="noop_train_loop",
    log=None,
    allow=False,
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
            allow_train_loop_change=allow,
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


@pytest.mark.parametrize("resume", ["auto", "must"])
def test_a_changed_training_config_is_refused_by_default_naming_each_change(storage, resume):
    """The default policy ("auto") as "must": a reused name does not go on silently with another
    training config; the refusal shows each change, old and new, and the setting that allows it."""
    started(storage, "run", config={"lr": 0.1, "faults": [{"rank": 1, "step": 7}]})
    before = files(storage, "run")
    with pytest.raises(ConfigError, match="run 'run' at .* \\(running\\) last trained with") as e:
        prepare(storage, "run", resume=resume, config={"lr": 0.01, "epochs": 3})
    message = str(e.value)
    assert "train_loop_config.lr: 0.1 -> 0.01" in message
    assert 'train_loop_config.faults: [{"rank": 1, "step": 7}] -> (removed)' in message
    assert "train_loop_config.epochs: (absent) -> 3" in message
    assert "set run_config.allow_train_loop_change=True to resume it" in message  # the fix
    with pytest.raises(
        ConfigError,
        match=r'train_loop: "tests.test_resume:noop_train_loop" -> '
        r'"tests.test_resume:other_train_loop"',
    ):
        prepare(
            storage,
            "run",
            resume=resume,
            config={"lr": 0.1, "faults": [{"rank": 1, "step": 7}]},
            loop="other_train_loop",
        )
    assert files(storage, "run") == before  # not even the lease was touched


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
def test_an_allowed_change_resumes_says_what_changed_and_records_it(storage):
    started(storage, "run", config={"lr": 0.1})
    log = []
    prepare(storage, "run", config={"lr": 0.01}, log=log, allow=True).release()
    assert (
        "warning: run 'run' resumes with a changed config: train_loop_config.lr: 0.1 -> 0.01" in log
    )
    assert load_state(storage, "run").config["train_loop_config"] == {"lr": 0.01}
    # the config it last trained with is the new one: that one alone resumes without the setting
    prepare(storage, "run", resume="must", config={"lr": 0.01}).release()
    with pytest.raises(ConfigError, match="lr: 0.01 -> 0.1"):
        prepare(storage, "run", config={"lr": 0.1})


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
        prepare(storage, "old", config={"lr": 0.2})
    plan = prepare(storage, "old", resume="must", config={"lr": 0.1})  # the same fingerprint
    assert plan.state.config["train_loop_config"] == {"lr": 0.1}  # recorded from now on
    plan.release()


def finished(target, name, config) -> dict[str, bytes]:
    """A run that finished (as its driver records it), and its files."""
    plan = prepare(target, name, config=config)
    plan.state.status = "finished"
    plan.store.save(plan.state)
    plan.release()
    return files(target, name)


@on_storage("local")
def test_a_finished_run_is_returned_unchanged_refused_changed_and_under_never(storage):
    before = finished(storage, "done", {"lr": 0.1})
    log = []
    again = prepare(storage, "done", resume="must", config={"lr": 0.1}, workers=3, log=log)
    assert again.finished and again.state.driver_runs == 1  # nothing will train
    state_file = f"{storage.path}/done/{STATE_FILE}"
    assert files(storage, "done")[state_file] == before[state_file] and log == [
        f"run 'done' at {storage.path}/done already finished; nothing to train"
    ]
    before = files(storage, "done")  # (that rerun took the lease, and released it)
    with pytest.raises(ConfigError, match="\\(finished\\) last trained with .*lr: 0.1 -> 0.5") as e:
        prepare(storage, "done", config={"lr": 0.5})
    assert "allow_train_loop_change=True to train it on from its final checkpoint" in str(e.value)
    assert files(storage, "done") == before
    with pytest.raises(ConfigError, match="already exists at .* \\(finished"):
        prepare(storage, "done", resume="never")


@on_storage("s3")
def test_a_finished_run_allowed_a_change_trains_on_with_a_fresh_budget(storage):
    finished(storage, "done", {"epochs": 1})
    log = []
    plan = prepare(storage, "done", config={"epochs": 2}, allow=True, log=log)
    assert not plan.finished and plan.state.status == "running" and plan.state.driver_runs == 2
    assert plan.state.budget_start == len(plan.state.failures)
    assert (
        "warning: run 'done' trains on from its final checkpoint with a changed config: "
        "train_loop_config.epochs: 1 -> 2" in log
    ), log
    plan.release()


def test_resume_is_a_flow_parameter_with_its_choices():
    from flows.train import train

    schema = train.parameters.model_dump()["definitions"]["RunConfig"]["properties"]["resume"]
    assert schema["enum"] == ["auto", "never", "must"] and schema["default"] == "auto"
    with pytest.raises(ValueError, match="resume"):
        ft_train.RunConfig(name="x", resume="always")


def test_a_finished_demo_run_refuses_more_epochs_by_default_and_trains_on_when_allowed(
    storage, prefect_api
):
    """Through the flow, with its ranks: the demo trained for 1 epoch, then asked for 2. Refused
    by default, before any worker starts, with the change shown and the run's files as they
    were; allowed, the run goes on from its final checkpoint (step 12 of 2 ranks' epoch), not
    from scratch, to the end of epoch 2."""
    from flows.train import train

    name = f"extend-{storage.kind}"  # flow runs of both storages share one Prefect API
    first = train_demo(storage, name, demo_config(epochs=1))
    assert first.status == "finished" and first.last_metrics["epoch"] == 1
    steps = first.last_metrics["step"]
    assert (
        train_demo(storage, name, demo_config(epochs=1)).last_metrics == first.last_metrics
    )  # unchanged
    before = files(storage, name)

    with pytest.raises(ConfigError, match="train_loop_config.epochs: 1 -> 2") as e:
        train_demo(storage, name, demo_config(epochs=2))
    assert "allow_train_loop_change=True to train it on from its final checkpoint" in str(e.value)
    assert files(storage, name) == before

    result = train(
        train_loop=DEMO,
        train_loop_config=demo_config(epochs=2),
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=run_config(storage, name, allow_train_loop_change=True),
    )
    assert result.status == "finished" and result.error is None
    assert result.last_metrics["epoch"] == 2 and result.last_metrics["step"] == 2 * steps
    assert result.last_metrics["resumed_from"] == steps  # the final checkpoint of epoch 1
    assert result.last_metrics["val_accuracy"] > first.last_metrics["val_accuracy"] - 0.05
    state = load_state(storage, name)
    assert state.status == "finished" and state.report_index == 2 * steps
    assert state.config["train_loop_config"]["epochs"] == 2 and state.driver_runs == 2
    assert len(state.attempts) == 2 and state.failures == []
