"""The code's seams, read from its syntax (ast) over `ft_train/`, `flows/` and `tasks/`:

- no module imports another module's private name (`from x import _name`);
- no `x._name` where `x` is not `self` or `cls` (nor `super()`): a module reaches into another
  object only through what that object makes public. Dunders are public. A third-party private
  API is allowed only in the one adapter module named for it in `ALLOWED`, with the reason;
- no import circle, imports under `if TYPE_CHECKING:` and inside functions counted: a circle
  that only type checking or a late import hides is still two modules that need each other.

An entry of `ALLOWED` whose reason begins "TODO" is a violation known and not yet fixed (in a
module another piece of work owns); every entry must still match something, so that a fixed
one is removed from the list.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
ROOTS = ("ft_train", "flows", "tasks")

# Names that begin with "_" but are documented public API.
DOCUMENTED = {
    "os._exit",  # the exit without cleanup, as a killed process ends (Python's os docs)
}
# A named tuple's documented methods and attributes, named with "_" to stay clear of its fields.
NAMED_TUPLE = {"_asdict", "_fields", "_field_defaults", "_make", "_replace"}

# (module, the expression as written) -> why it is allowed: third-party private APIs, each in
# the one adapter module of its library, and "TODO" for those not there yet.
ALLOWED: dict[tuple[str, str], str] = {
    ("ft_train.storage.fs", "self.fs._strip_protocol"): (
        "fsspec's path without its protocol, as every fsspec filesystem computes it; "
        "storage.fs is ft-train's one adapter of fsspec"
    ),
    ("ft_train.torch", "loader._ft_device"): (
        "this module's own attribute (its class `_Prepared` declares it), on the user's "
        "loader object: the prefix keeps it apart from the loader's attributes"
    ),
    ("ft_train.torch", "loader._ft_non_blocking"): "as loader._ft_device",
    ("ft_train.compat.forkserver", "forkserver._forkserver"): (
        "CPython's one fork server, whose preload list and pid have no public getter; "
        "compat.forkserver is ft-train's one adapter of it (names checked by "
        "tests/unit/test_private_apis.py)"
    ),
    ("ft_train.compat.forkserver", "the_server()._forkserver_pid"): "as forkserver._forkserver",
    ("ft_train.compat.forkserver", "the_server()._preload_modules"): "as forkserver._forkserver",
    ("ft_train.compat.dask_broker", "scheduler._broker"): (
        "distributed's Scheduler._broker, to keep no history of a topic's events; "
        "compat.dask_broker is ft-train's one adapter of it (tests/unit/test_private_apis.py)"
    ),
    ("ft_train.compat.dask_broker", "broker._topics"): "as scheduler._broker",
    ("ft_train.compat.torch_distributed", "import torch._dynamo"): (
        "imported ahead, so that the first DDP does not import it within the watchdog's time; "
        "compat.torch_distributed is ft-train's one adapter of torch.distributed's private names "
        "(checked by tests/unit/test_private_apis.py)"
    ),
    ("ft_train.compat.torch_distributed", "dist.ProcessGroupGloo._Options"): (
        "torch has no public way to build a gloo group on the default group's device with one "
        "thread (the control group); as import torch._dynamo"
    ),
    ("ft_train.compat.torch_distributed", "options._devices"): "as dist.ProcessGroupGloo._Options",
    ("ft_train.compat.torch_distributed", "options._timeout"): "as dist.ProcessGroupGloo._Options",
    ("ft_train.compat.torch_distributed", "options._threads"): "as dist.ProcessGroupGloo._Options",
    ("ft_train.compat.torch_distributed", "default._devices"): "as dist.ProcessGroupGloo._Options",
    ("ft_train.compat.torch_distributed", "default._timeout"): "as dist.ProcessGroupGloo._Options",
    ("ft_train.compat.torch_distributed", "dist.distributed_c10d._get_default_store"): (
        "the default group's store, which torch does not expose; as import torch._dynamo"
    ),
    ("ft_train.compat.torch_distributed", "dist.distributed_c10d._get_default_group"): (
        "as dist.distributed_c10d._get_default_store"
    ),
    (
        "ft_train.compat.torch_distributed",
        "dist.distributed_c10d._get_default_group()._get_backend",
    ): ("as dist.distributed_c10d._get_default_store"),
}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_of(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an ImportFrom names."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(name: str, path: pathlib.Path) -> list[str]:
    """Each private name `name` imports from another module, and each `x._name` whose `x` is
    not self, cls or super(), as written."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [
                f"from {resolve(node, package_of(name, path))} import {a.name}"
                for a in node.names
                if private(a.name)
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"import {a.name}" for a in node.names if any(map(private, a.name.split(".")))
            ]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
            and node.args[1].value not in NAMED_TUPLE
            and ast.unparse(node.args[0]) not in ("self", "cls")
        ):  # the same reach, spelled with a string
            found.append(f"{ast.unparse(node.args[0])}.{node.args[1].value}")
        elif isinstance(node, ast.Attribute) and private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            if ast.unparse(node) not in DOCUMENTED and node.attr not in NAMED_TUPLE:
                found.append(ast.unparse(node))
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its code, TYPE_CHECKING blocks
    and functions included. `from p import x` depends on the module p.x where x is one, else on
    p; a package's own __init__ is not counted for a module imported from it (Python runs it,
    but a half-initialised package is no circle of the code's own making)."""
    package = package_of(name, path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node, package)
            subs = {f"{base}.{a.name}" for a in node.names} & known.keys()
            found |= subs or {base}
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_uses_another_modules_private_names():
    seen, bad = set(), []
    for name, path in sorted(modules().items()):
        for use in private_uses(name, path):
            if (name, use) in ALLOWED:
                seen.add((name, use))
            else:
                bad.append(f"{name}: {use}")
    assert not bad, (
        "private names used from outside their module (make them public, give the owner a "
        "method, or, for a third-party private API, keep it in its adapter module and list it "
        "in ALLOWED with the reason):\n  " + "\n  ".join(bad)
    )
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_todo_entries_are_listed_for_the_lead():
    todo = sorted(f"{m}: {use}" for (m, use), why in ALLOWED.items() if why.startswith("TODO"))
    print("private uses still to fix:\n  " + "\n  ".join(todo or ["none"]))


def test_no_import_circle_even_under_type_checking():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = circles(graph)
    assert not found, "modules that import each other (TYPE_CHECKING and late imports count):\n" + (
        "\n".join(f"  {' <-> '.join(c)}" for c in found)
    )


def test_the_checks_see_what_they_look_for(tmp_path):
    """The checks on a module written to break each rule: they must be able to fail."""
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .other import _hidden, shown\n"
        "if TYPE_CHECKING:\n"
        "    from .other import Thing\n"
        "class C:\n"
        "    def f(self, o):\n"
        "        return self._a, cls._b, super()._c, o._d, o.__dict__, mod._e(), os._exit\n"
        "    def g(self, o):\n"
        "        return getattr(o, '_f', None), getattr(self, '_g'), getattr(o, 'h')\n"
    )
    assert sorted(private_uses("pkg.m", path)) == [
        "from pkg.other import _hidden",
        "mod._e",
        "o._d",
        "o._f",
    ]
    known = {"pkg.m": path, "pkg.other": path}
    assert imports("pkg.m", path, known) == {"pkg.other"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
