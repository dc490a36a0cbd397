"""The Lightning integration's refusals and names, without ranks (issue 44): for both packages,
`prepare_trainer` refuses a Trainer that would not train on ft-train's ranks, naming what to pass;
the strategies refuse the arguments that are ft-train's; Ray's `ft_train.lightning` names are the
integration's very objects, and `RayDeepSpeedStrategy` is refused naming what to use. The runs on
ranks, under faults: tests/test_lightning.py."""

from __future__ import annotations

import datetime
import importlib

import pytest

from ft_train.errors import ConfigError


@pytest.fixture(params=["lightning", "pytorch_lightning"])
def package(request):
    return request.param


def lightning(package: str):
    return importlib.import_module("lightning.pytorch" if package == "lightning" else package)


def ours(package: str):
    return importlib.import_module(f"ft_train.integrations.{package}")


def trainer(package: str, **kw):
    return lightning(package).Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def test_prepare_trainer_refuses_lightnings_own_ddp(package):
    # Lightning's DDPStrategy shards the data over the devices one rank sees (1), not the ranks
    with pytest.raises(
        ConfigError, match=rf"strategy=ft_train\.integrations\.{package}\.DDPStrategy"
    ):
        ours(package).prepare_trainer(trainer(package, strategy="ddp"))


def test_prepare_trainer_refuses_fsdp_on_cpu(package):
    # torch's FSDP would raise on every rank ("FSDP needs a non-CPU accelerator device"), a
    # failure per attempt: refused once, before training, naming both ways out
    for strategy in (ours(package).FSDPStrategy(), _ray_fsdp(package)):
        with pytest.raises(ConfigError, match=r"FSDP needs GPUs.*use_gpu=True.*DDPStrategy"):
            ours(package).prepare_trainer(trainer(package, strategy=strategy))


def _ray_fsdp(package: str):
    import ft_train.lightning as ray

    # Ray's name serves one package (the one imported first, else `lightning`)
    same = ray.RayFSDPStrategy.__module__ == ours(package).__name__
    return ray.RayFSDPStrategy() if same else ours(package).FSDPStrategy()


def test_prepare_trainer_refuses_another_cluster_environment(package):
    environments = importlib.import_module(f"{lightning(package).__name__}.plugins.environments")
    built = trainer(
        package,
        strategy=ours(package).DDPStrategy(),
        plugins=[environments.LightningEnvironment()],
    )
    with pytest.raises(
        ConfigError, match=r"plugins=\[ft_train\.integrations\..*FtTrainEnvironment"
    ):
        ours(package).prepare_trainer(built)


def test_prepare_trainer_refuses_a_trainer_of_the_other_package(package):
    other = "pytorch_lightning" if package == "lightning" else "lightning"
    with pytest.raises(ConfigError, match=rf"from ft_train\.integrations\.{other}\b"):
        ours(package).prepare_trainer(trainer(other))


@pytest.mark.parametrize(
    "argument, value, fix",
    [
        ("process_group_backend", "nccl", "ScalingConfig"),
        ("timeout", datetime.timedelta(seconds=5), "hang_timeout_s"),
    ],
)
def test_strategies_refuse_what_ft_train_owns(package, argument, value, fix):
    for strategy in (ours(package).DDPStrategy, ours(package).FSDPStrategy):
        with pytest.raises(ConfigError, match=rf"\({argument}=\.\.\.\).*{fix}"):
            strategy(**{argument: value})


@pytest.mark.parametrize("every", [0, -2, 1.5, True, "3"])
def test_report_callback_refuses_a_bad_interval(package, every):
    with pytest.raises(ConfigError, match=r"every_n_train_steps=.*whole number"):
        ours(package).ReportCallback(every_n_train_steps=every)


def test_classes_derive_from_their_package(package):
    pl, mine = lightning(package), ours(package)
    assert issubclass(mine.ReportCallback, pl.callbacks.Callback)
    assert issubclass(mine.DDPStrategy, pl.strategies.DDPStrategy)
    assert issubclass(mine.FSDPStrategy, pl.strategies.FSDPStrategy)
    environment = mine.FtTrainEnvironment()  # every abstract method is implemented
    assert environment.creates_processes_externally
    assert not mine.FtTrainEnvironment.detect()  # not inside a rank
    assert mine.ReportCallback.CHECKPOINT_NAME == mine.CHECKPOINT_NAME == "checkpoint.ckpt"
    assert mine.DDPStrategy.__module__ == mine.__name__  # where pickle and reprs find it


def test_rays_names_are_the_integrations_objects():
    import ft_train.lightning as ray

    mine = importlib.import_module(ray.RayDDPStrategy.__module__)
    assert mine.__name__ in (
        "ft_train.integrations.lightning",
        "ft_train.integrations.pytorch_lightning",
    )
    assert ray.RayDDPStrategy is mine.DDPStrategy
    assert ray.RayFSDPStrategy is mine.FSDPStrategy
    assert ray.RayLightningEnvironment is mine.FtTrainEnvironment
    assert ray.RayTrainReportCallback is mine.ReportCallback
    assert ray.prepare_trainer is mine.prepare_trainer
    assert ray.RayTrainReportCallback.CHECKPOINT_NAME == "checkpoint.ckpt"  # Ray's


def test_ray_deepspeed_strategy_is_refused_naming_what_to_use():
    with pytest.raises(ConfigError, match=r"ft_train\.lightning\.RayFSDPStrategy"):
        from ft_train.lightning import RayDeepSpeedStrategy  # noqa: F401
