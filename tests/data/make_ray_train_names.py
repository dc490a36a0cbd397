"""Writes `ray_train_names.json` beside it: the public Ray Train V2 names a ported script meets,
read from Ray's own source (the wheel, unzipped), never from memory and never by importing Ray.

    pip download --no-deps ray==2.60.0 -d /tmp/raywheel
    unzip -q /tmp/raywheel/ray-2.60.0-*.whl 'ray/train/*' 'ray/air/*' -d /tmp/raywheel/x
    python tests/data/make_ray_train_names.py /tmp/raywheel/x

What it reads, with `ast` only:
- the exports of `ray.train`, `ray.train.torch` and `ray.train.collective` with Ray Train V2
  enabled (`__all__`, with the names `ray/train/__init__.py` adds under `if is_v2_enabled():`);
- the fields of the V2 config classes (`ray/train/v2/api/config.py`) with those of their V1 bases
  (`ray/air/config.py`), as the dataclasses hold them;
- the parameters of `report()`, `get_all_reported_checkpoints()`, `prepare_model()`,
  `prepare_data_loader()`, `broadcast_from_rank_zero()` and `TorchTrainer.__init__`;
- the public members of `Checkpoint`, `Result` (with its V1 base), `TrainContext`,
  `TorchTrainer` (with `DataParallelTrainer`), `WorkerGroupError` and `CheckpointUploadMode`.

A field or a parameter comes with its `default` as Ray's source text (null: none). Each name is
marked `ray_deprecated` where Ray 2.60 itself refuses it (a `_DEPRECATED` default, a
`@Deprecated` method, or a `DeprecationWarning` raised when it is set). The tests read only the
JSON: they need neither Ray nor the network.
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).with_name("ray_train_names.json")
VERSION = "2.60.0"


def _tree(root: pathlib.Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text())


def _strings(node: ast.AST) -> list[str]:
    return [e.value for e in node.elts if isinstance(e, ast.Constant)]  # type: ignore[attr-defined]


def _is_v2_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "is_v2_enabled" in ast.unparse(node.test)


def exports(root: pathlib.Path, rel: str) -> list[str]:
    """`__all__` as Ray builds it with V2 enabled: the plain list, plus `__all__.extend([...])`
    and an `__all__ = [...]` inside `if is_v2_enabled():` (never its `else:`)."""
    tree = _tree(root, rel)
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if _is_v2_block(node):
                visit(node.body)  # type: ignore[attr-defined]
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names.extend(_strings(node.value))
            elif isinstance(node, ast.Expr) and ast.unparse(node.value).startswith(
                "__all__.extend("
            ):
                names.extend(_strings(node.value.args[0]))  # type: ignore[attr-defined]

    visit(tree.body)
    return list(dict.fromkeys(names))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(name)


def _decorated_deprecated(fn: ast.FunctionDef) -> bool:
    return any("Deprecated" in ast.unparse(d) for d in fn.decorator_list)


def _post_init_deprecations(cls: ast.ClassDef) -> set[str]:
    """Fields whose being set makes `__post_init__` raise DeprecationWarning."""
    found: set[str] = set()
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__":
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and any(
                    isinstance(r, ast.Raise) and "DeprecationWarning" in ast.unparse(r)
                    for r in node.body
                ):
                    test = ast.unparse(node.test)
                    found |= {
                        a.attr
                        for a in ast.walk(node.test)
                        if isinstance(a, ast.Attribute) and test.startswith("self.")
                    }
    return found


def fields(cls: ast.ClassDef) -> dict[str, tuple[bool, str | None]]:
    """A dataclass's public fields, each with whether Ray refuses it as deprecated, and its
    default as source text (None: it has none)."""
    deprecated = _post_init_deprecations(cls)
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if name.startswith("_"):
                continue
            default = ast.unparse(node.value) if node.value else None
            out[name] = ("_DEPRECATED" in (default or "") or name in deprecated, default)
    return out


def config_fields(root: pathlib.Path, name: str) -> dict[str, tuple[bool, str | None]]:
    """The V2 class's fields after its V1 base's, as the dataclass orders them."""
    v2 = _class(_tree(root, "ray/train/v2/api/config.py"), name)
    out: dict[str, tuple[bool, str | None]] = {}
    for base in v2.bases:
        base_name = ast.unparse(base).removesuffix("V1")
        if base_name == name:
            out.update(fields(_class(_tree(root, "ray/air/config.py"), name)))
    out.update(fields(v2))  # the V2 class overrides the base's default
    return out


def parameters(fn: ast.FunctionDef) -> dict[str, str | None]:
    """A function's parameters (not self or cls), each with its default as source text."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
    return {
        a.arg: (ast.unparse(d) if d is not None else None)
        for a, d in pairs
        if a.arg not in ("self", "cls")
    }


def function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(name)


def members(cls: ast.ClassDef, kinds: str) -> dict[str, bool]:
    """A class's public members, each with whether Ray refuses it as deprecated: by `kinds`,
    "m" its methods and properties, "f" its dataclass fields, "a" the attributes its `__init__`
    sets, "e" its enum members. (A trainer's attributes are its internals: not listed.)"""
    out: dict[str, bool] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            if not node.name.startswith("_") and "m" in kinds:
                out[node.name] = _decorated_deprecated(node) or any(
                    isinstance(r, ast.Raise) and "DeprecationWarning" in ast.unparse(r)
                    for r in node.body
                )
            elif node.name == "__init__" and "a" in kinds:
                for a in ast.walk(node):
                    if (
                        isinstance(a, ast.Attribute)
                        and isinstance(a.ctx, ast.Store)
                        and ast.unparse(a.value) == "self"
                        and not a.attr.startswith("_")
                    ):
                        out[a.attr] = False
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_") and "f" in kinds:
                out[node.target.id] = False
        elif isinstance(node, ast.Assign) and "e" in kinds:
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id.isupper():
                    out[t.id] = False  # an enum member
    return out


def collect(root: pathlib.Path) -> list[dict]:
    rows: list[dict] = []

    def add(
        name: str, kind: str, source: str, deprecated: bool = False, **default: str | None
    ) -> None:
        row = {"name": name, "kind": kind, "source": source, "ray_deprecated": deprecated}
        rows.append(row | default)

    for module, rel in [
        ("ray.train", "ray/train/__init__.py"),
        ("ray.train.torch", "ray/train/torch/__init__.py"),
        ("ray.train.collective", "ray/train/collective/__init__.py"),
    ]:
        for name in exports(root, rel):
            add(f"{module}.{name}", "export", rel)

    config = "ray/train/v2/api/config.py"
    for cls in ["RunConfig", "ScalingConfig", "FailureConfig", "CheckpointConfig"]:
        for field, (deprecated, default) in config_fields(root, cls).items():
            add(f"ray.train.{cls}.{field}", "field", config, deprecated, default=default)

    api = "ray/train/v2/api/train_fn_utils.py"
    torch_utils = "ray/train/v2/torch/train_loop_utils.py"
    collectives = "ray/train/collective/collectives.py"
    trainer = "ray/train/v2/torch/torch_trainer.py"
    for qualified, rel, fn in [
        ("ray.train.report", api, "report"),
        ("ray.train.get_all_reported_checkpoints", api, "get_all_reported_checkpoints"),
        ("ray.train.torch.prepare_model", torch_utils, "prepare_model"),
        ("ray.train.torch.prepare_data_loader", torch_utils, "prepare_data_loader"),
        ("ray.train.collective.broadcast_from_rank_zero", collectives, "broadcast_from_rank_zero"),
        ("ray.train.torch.TorchTrainer", trainer, "__init__"),
    ]:
        for p, default in parameters(function(_tree(root, rel), fn)).items():
            add(f"{qualified}({p}=)", "parameter", rel, default=default)

    for qualified, kinds, parts in [
        ("ray.train.Checkpoint", "ma", [("ray/train/_checkpoint.py", "Checkpoint")]),
        (
            "ray.train.Result",
            "mf",
            [("ray/air/result.py", "Result"), ("ray/train/v2/api/result.py", "Result")],
        ),
        ("ray.train.TrainContext", "m", [("ray/train/v2/api/context.py", "TrainContext")]),
        (
            "ray.train.torch.TorchTrainer",
            "m",
            [
                ("ray/train/v2/api/data_parallel_trainer.py", "DataParallelTrainer"),
                (trainer, "TorchTrainer"),
            ],
        ),
        (
            "ray.train.WorkerGroupError",
            "a",
            [("ray/train/v2/api/exceptions.py", "WorkerGroupError")],
        ),
        (
            "ray.train.CheckpointUploadMode",
            "e",
            [("ray/train/v2/api/report_config.py", "CheckpointUploadMode")],
        ),
    ]:
        found: dict[str, tuple[bool, str]] = {}
        for rel, cls in parts:
            for member, deprecated in members(_class(_tree(root, rel), cls), kinds).items():
                found[member] = (deprecated, rel)
        for member, (deprecated, rel) in found.items():
            add(f"{qualified}.{member}", "member", rel, deprecated)
    return rows


def main(root: str) -> None:
    rows = collect(pathlib.Path(root))
    document = {
        "about": (
            f"Ray Train {VERSION}'s public names with V2 enabled, read with `ast` from the "
            f"ray=={VERSION} wheel by tests/data/make_ray_train_names.py (see its docstring to "
            "rerun it). tests/unit/test_ray_names.py checks each against ft_train and "
            "docs/migrating-from-ray.md. Do not edit by hand."
        ),
        "ray_version": VERSION,
        "names": rows,
    }
    OUT.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{len(rows)} names -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
