"""Every Ray Train name on the checked-in list (`tests/data/ray_train_names.json`, read from Ray
2.60's wheel) works in ft-train with Ray's meaning, or is refused, before any worker starts, with
the stated error and a message naming what to use instead; and `docs/migrating-from-ray.md`'s
tables cover every name on the list, each marked as this test finds it."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import pathlib
import re

import pytest

import ft_train
from ft_train import ConfigError, SessionError, ray_names

REPO = pathlib.Path(__file__).resolve().parents[2]
LISTED = json.loads((REPO / "tests/data/ray_train_names.json").read_text())["names"]
DOC = REPO / "docs/migrating-from-ray.md"

# Refused by the piece that owns the name, in its own code rather than through `ray_names`: the
# error type, and what its message must hold.
REFUSED_ELSEWHERE: dict[str, tuple[type[Exception], str]] = {
    **{
        f"ray.train.torch.TorchTrainer({p}=)": (ConfigError, p)
        for p in [
            "torch_config",
            "datasets",
            "dataset_config",
            "validation_config",
            "metadata",
            "resume_from_checkpoint",
        ]
    },
    "ray.train.torch.TorchTrainer.restore": (ConfigError, "storage_path"),
    "ray.train.torch.TorchTrainer.can_restore": (ConfigError, "storage_path"),
    "ray.train.report(checkpoint_upload_fn=)": (SessionError, "checkpoint_upload_fn"),
    "ray.train.report(validation=)": (SessionError, "validation"),
}

# Ray's default differs on purpose, and the migration guide says so.
OTHER_DEFAULT = {
    "ray.train.RunConfig.storage_path",  # ~/ray_results there, ~/ft_train_results here
}

# The class ft-train gives Ray's class under each name.
CLASSES = {
    "ray.train.Result": "ft_train.TrainResult",
    "ray.train.Checkpoint": "ft_train.Checkpoint",
    "ray.train.TrainContext": "ft_train.TrainContext",
    "ray.train.WorkerGroupError": "ft_train.WorkerGroupError",
    "ray.train.CheckpointUploadMode": "ft_train.CheckpointUploadMode",
    "ray.train.torch.TorchTrainer": "ft_train.torch.TorchTrainer",
    "ray.train.RunConfig": "ft_train.RunConfig",
    "ray.train.ScalingConfig": "ft_train.ScalingConfig",
    "ray.train.FailureConfig": "ft_train.FailureConfig",
    "ray.train.CheckpointConfig": "ft_train.CheckpointConfig",
}
# An instance, where Ray's member is an attribute its constructor sets.
INSTANCES = {"ray.train.Checkpoint": lambda: ft_train.Checkpoint("/tmp/a-checkpoint")}
FUNCTIONS = {
    "ray.train.report": "ft_train.report",
    "ray.train.get_all_reported_checkpoints": "ft_train.get_all_reported_checkpoints",
    "ray.train.torch.prepare_model": "ft_train.torch.prepare_model",
    "ray.train.torch.prepare_data_loader": "ft_train.torch.prepare_data_loader",
    "ray.train.collective.broadcast_from_rank_zero": "ft_train.collective.broadcast_from_rank_zero",
    "ray.train.torch.TorchTrainer": "ft_train.torch.TorchTrainer",
}


def resolve(dotted: str):
    """`ft_train.a.b.c` imported and looked up. A class's instance attribute (a config's field, a
    dataclass's field, a constructor's parameter) is looked up as the class itself."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if isinstance(obj, type) and (
                part in getattr(obj, "model_fields", {})
                or (
                    dataclasses.is_dataclass(obj)
                    and part in {f.name for f in dataclasses.fields(obj)}
                )
                or part in inspect.signature(obj).parameters
            ):
                continue
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def split(row: dict) -> tuple[str, str]:
    """(owner, member) of a listed name: ('ray.train.report', 'checkpoint') for a parameter."""
    name = row["name"]
    if row["kind"] == "parameter":
        owner, param = re.fullmatch(r"(.+)\((\w+)=\)", name).groups()
        return owner, param
    owner, _, member = name.rpartition(".")
    return owner, member


def ours(owner: str) -> str:
    """The ft-train module or class where a Ray owner's names are looked for."""
    return CLASSES.get(owner) or FUNCTIONS.get(owner) or owner.replace("ray.train", "ft_train", 1)


def where_refused(row: dict) -> str:
    """The key of `ray_names.REFUSED` that may refuse this name (a module, or a class)."""
    owner, _ = split(row)
    return ours(owner).rpartition(".")[2] if owner in CLASSES else ours(owner)


def decision(row: dict) -> str:
    """'refused' where ft-train refuses the name (here or in the piece that owns it), else
    'works'."""
    _, member = split(row)
    if row["name"] in REFUSED_ELSEWHERE or member in ray_names.REFUSED.get(where_refused(row), {}):
        return "refused"
    return "works"


def touch(row: dict) -> object:
    """Use the name as a ported script would, in ft-train: return what it gives."""
    owner, member = split(row)
    if row["kind"] == "export":
        module = importlib.import_module(ours(owner))
        namespace: dict = {}
        exec(f"from {module.__name__} import {member} as found", namespace)
        return namespace["found"]
    if row["kind"] == "field":
        return resolve(ours(owner))(**{member: None})
    if row["kind"] == "parameter":
        target = resolve(ours(owner))
        if owner == "ray.train.torch.TorchTrainer":
            return target(lambda: None, **{member: object()})
        return target({}, **{member: lambda *a: None})  # report()
    cls = resolve(ours(owner))
    found = getattr(object.__new__(cls), member)  # a bare instance: no constructor needed
    return found() if callable(found) and row["name"] in REFUSED_ELSEWHERE else found


def works(row: dict) -> None:
    """Assert that the name exists in ft-train, with Ray's meaning where a test can tell."""
    owner, member = split(row)
    target = resolve(ours(owner))
    if row["kind"] == "export":
        assert hasattr(target, member), f"ft_train has no {member}"
        if member == "Result":
            assert ft_train.Result is ft_train.TrainResult
    elif row["kind"] == "field":
        field = target.model_fields.get(member)
        assert field is not None, f"{target.__name__} has no field {member}"
        assert_same_default(
            row, None if field.is_required() else field.get_default(call_default_factory=True)
        )
    elif row["kind"] == "parameter":
        params = inspect.signature(target).parameters
        assert member in params, f"{ours(owner)}() has no parameter {member}"
        default = params[member].default
        assert_same_default(row, None if default is inspect.Parameter.empty else default)
    elif dataclasses.is_dataclass(target) and member in {
        f.name for f in dataclasses.fields(target)
    }:
        pass  # a field of TrainResult's, set by its constructor
    elif owner == "ray.train.CheckpointUploadMode":
        assert getattr(target, member).value == member, "Ray's values are the members' names"
    elif owner == "ray.train.WorkerGroupError":
        assert member in inspect.signature(target).parameters or hasattr(target, member)
    else:
        instance = INSTANCES.get(owner, lambda: target)()
        assert hasattr(instance, member), f"{ours(owner)} has no {member}"


def assert_same_default(row: dict, ft_default: object) -> None:
    """Where Ray's default is a literal, ft-train's is the same (a setting left out means what it
    means in Ray); Ray's `None` for a config field stands for a default object."""
    ray = row.get("default")
    if ray is None or row["name"] in OTHER_DEFAULT:
        return
    try:
        value = ast.literal_eval(ray)
    except ValueError:
        return  # an expression, e.g. CheckpointUploadMode.SYNC: compared by the member test
    if value is None and row["kind"] == "field" and ft_default is not None:
        return
    assert ft_default == value, f"{row['name']}: Ray's default is {ray}, ft-train's {ft_default!r}"


@pytest.mark.parametrize("row", LISTED, ids=[r["name"] for r in LISTED])
def test_each_ray_name_works_or_is_refused_naming_the_alternative(row):
    if decision(row) == "works":
        works(row)
        return
    expected, text = REFUSED_ELSEWHERE.get(row["name"], (ConfigError, None))
    if text is None:
        _, member = split(row)
        text = ray_names.REFUSED[where_refused(row)][member]
    with pytest.raises(expected) as raised:
        touch(row)
    assert text in str(raised.value)


def test_the_list_was_made_from_ray_and_names_each_kind():
    kinds = {r["kind"] for r in LISTED}
    assert kinds == {"export", "field", "parameter", "member"}
    names = {r["name"] for r in LISTED}
    assert len(names) == len(LISTED)
    # a few that every port meets, as a guard against a list read from the wrong place
    assert {
        "ray.train.report",
        "ray.train.torch.TorchTrainer",
        "ray.train.collective.barrier",
        "ray.train.RunConfig.storage_path",
        "ray.train.report(checkpoint_upload_mode=)",
    } <= names


def test_every_refusal_is_of_a_listed_name():
    """A refusal of a name Ray does not have would be a guess about Ray."""
    listed = {(where_refused(r), split(r)[1]) for r in LISTED}
    for where, names in ray_names.REFUSED.items():
        for name in names:
            assert (where, name) in listed, f"{where}.{name} is not on Ray's list"
    assert set(REFUSED_ELSEWHERE) <= {r["name"] for r in LISTED}


def test_the_alternatives_named_exist():
    for names in ray_names.REFUSED.values():
        for instead in names.values():
            for dotted in re.findall(r"`(ft_train\.[\w.]+)`", instead):
                resolve(dotted)  # raises where the alternative is not there


def test_a_refused_name_is_not_offered_too():
    """A module's name both offered and refused: the refusal is dead; a config's field both:
    it refuses a setting that works. (A class may refuse by a property that raises: Python
    then asks `RefusesRayNames.__getattr__`, which refuses as `ray_names` says.)"""
    for row in LISTED:
        owner, member = split(row)
        if member not in ray_names.REFUSED.get(where_refused(row), {}):
            continue
        target = resolve(ours(owner))
        if row["kind"] == "field":
            assert member not in target.model_fields, f"{row['name']} is a field now"
        elif row["kind"] == "export":
            assert member not in vars(target), f"{row['name']} is offered now"


def test_what_ray_itself_refuses_is_refused():
    """Ray 2.60 raises on its deprecated names: accepting one would give it another meaning."""
    for row in LISTED:
        if row["ray_deprecated"]:
            assert decision(row) == "refused", row["name"]


def test_a_refusal_comes_at_import_and_as_a_config_error_from_a_flow_parameter():
    with pytest.raises(ConfigError, match="prepare_data_loader"):
        exec("from ft_train import get_dataset_shard", {})
    from ft_train.config import parse

    with pytest.raises(
        ConfigError, match=r"run_config\.failure_config: .*worker_start_timeout_s"
    ) as e:
        parse(
            ft_train.RunConfig,
            {
                "name": "r",
                "storage_options": {"key": "AKIA-not-to-be-echoed"},
                "failure_config": {"controller_failure_limit": 2},
            },
            "run_config",
        )
    assert "AKIA" not in str(e.value)
    # a name Ray does not have stays an AttributeError
    with pytest.raises(AttributeError):
        ft_train.no_such_name  # noqa: B018


def doc_rows() -> dict[str, list[str]]:
    """The migration guide's table rows by their first cell's Ray name (in backticks)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells
    return rows


def test_the_migration_guide_covers_every_listed_name_as_it_is():
    rows = doc_rows()
    missing = [r["name"] for r in LISTED if r["name"] not in rows]
    assert not missing, f"docs/migrating-from-ray.md lacks {missing}"
    for row in LISTED:
        marked = "refused" if "refused" in rows[row["name"]][1].lower() else "works"
        assert marked == decision(row), f"{row['name']}: the guide says {marked}"
