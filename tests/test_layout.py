"""The shape of the code: no import circle inside `ft_train`, `ft_train` never imports Prefect nor
its adapters (it is the library; `flows/`, `tasks/`, `cli/` and `deployments/` sit on the other
side of the line) except through the flow's one entry point, and a long module or function says
why it is one piece."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = REPO / "ft_train"


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in LIBRARY.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The `ft_train` modules `name` imports, at any depth of its code (a function's own imports
    too), except under `if TYPE_CHECKING:`. `from . import x` depends on x, not on the package."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = (
                node.module or ""
                if not node.level
                else ".".join(
                    parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                )
            )
            subs = {f"{base}.{a.name}" for a in node.names} & known.keys()
            found |= subs or {base}
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted(component + [v]))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_inside_ft_train():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["ft_train.worker.session"], "the import graph was read"  # the test can see imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ADAPTERS = ("flows", "tasks", "cli", "deployments")


def test_ft_train_never_imports_an_adapter():
    """Not even inside a function, as the command line did while it lived in `ft_train`."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module]
            else:
                continue
            found += [f"{name} imports {t}" for t in targets if t.split(".")[0] in ADAPTERS]
    assert found == []


def test_ft_train_never_imports_prefect():
    names = sorted(name for name in modules() if not name.startswith("ft_train.examples"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# A string that names an adapter's module (`importlib.import_module("flows.train")`, ...).
ADAPTER_PATH = re.compile(rf"({'|'.join(ADAPTERS)})([.:][A-Za-z_][\w.]*)*")
FLOW_ENTRY_POINT = {"flow": "flows.train:train"}  # group ft_train, DESIGN.md


def indirections() -> list[str]:
    """Where `ft_train` could reach an adapter around its imports: a string naming an adapter's
    module, or a read of entry points (`importlib.metadata.entry_points`)."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if ADAPTER_PATH.fullmatch(node.value):
                    found.append(f"{name}:{node.lineno} names {node.value!r}")
            elif isinstance(node, (ast.Name, ast.Attribute)):
                if (node.id if isinstance(node, ast.Name) else node.attr) == "entry_points":
                    found.append(f"{name}:{node.lineno} reads entry points")
    return found


def test_the_flows_entry_point_is_the_librarys_only_way_to_an_adapter():
    """`TorchTrainer.fit()` calls the flow, found through one entry point (group `ft_train`,
    name `flow`, DESIGN.md): the trainer reads it, and the group holds that one alone, so it is
    no way to another adapter. Nothing else in `ft_train` names an adapter's module."""
    from ft_train import trainer

    assert indirections() == [f"ft_train.trainer:{_line_of(trainer.find_flow)} reads entry points"]
    assert (trainer.FLOW_GROUP, trainer.FLOW_NAME) == ("ft_train", "flow")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["ft_train"] == FLOW_ENTRY_POINT


def _line_of(fn) -> int:
    """The line of the one `entry_points` call in `fn`."""
    tree = ast.parse(pathlib.Path(fn.__code__.co_filename).read_text())
    (line,) = {
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "entry_points"
    }
    return line


def test_the_indirection_check_sees_a_string_path_to_an_adapter():
    for text in ["flows.train", "flows.train:train", "tasks", "cli.main:main", "deployments.demo"]:
        assert ADAPTER_PATH.fullmatch(text), text
    for text in ["ft_train.torch", "the flows module", "tasks/", "my_pkg.flows"]:
        assert not ADAPTER_PATH.fullmatch(text), text


def test_the_trainer_imports_no_prefect_until_fit_loads_the_flow():
    code = (
        "import sys\n"
        "from ft_train.torch import TorchTrainer\n"
        "from ft_train.trainer import find_flow\n"
        "TorchTrainer('tests.loops:report_many', train_loop_config={'n': 1})\n"
        f"sides = {('prefect', *ADAPTERS)!r}\n"
        "before = sorted({m.split('.')[0] for m in sys.modules} & set(sides))\n"
        "flow = find_flow()\n"
        "import flows.train\n"
        "print(before, flow is flows.train.train)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[] True"


SIZED = ("ft_train", "flows", "tasks", "cli", "deployments")
MODULE_LINES, FUNCTION_LINES = 600, 60
MARK = "One piece:"


def _says_one_piece(docstring: str | None) -> bool:
    """Does the docstring hold a paragraph that begins `One piece:` (and says why after it)?"""
    if not docstring:
        return False
    for paragraph in docstring.split("\n\n"):
        text = paragraph.strip()
        if text.startswith(MARK) and len(text) > len(MARK) + 10:
            return True
    return False


def long_pieces() -> tuple[list[str], list[str]]:
    """(those past the size rule without a reason, those past it that give one)."""
    unexplained, explained = [], []
    for top in SIZED:
        for path in sorted((REPO / top).rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(REPO)
            tree = ast.parse(text)
            lines = len(text.splitlines())
            if lines > MODULE_LINES:
                entry = f"{where}: {lines} lines"
                (explained if _says_one_piece(ast.get_docstring(tree)) else unexplained).append(
                    entry
                )
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    length = node.end_lineno - first + 1
                    if length > FUNCTION_LINES:
                        entry = f"{where}:{node.lineno} {node.name}(): {length} lines"
                        says = _says_one_piece(ast.get_docstring(node))
                        (explained if says else unexplained).append(entry)
    return unexplained, explained


def test_a_long_module_or_function_says_why_it_is_one_piece():
    """Code is split by responsibility, never to meet a number: a module past 600 lines or a
    function past 60 (decorators and docstring included) is allowed, when its docstring has a
    paragraph that begins `One piece:` and says why a reader is better served by one piece."""
    unexplained, explained = long_pieces()
    print("\nOne piece: (long, with the reason in the docstring)")
    for entry in explained or ["(none)"]:
        print("    " + entry)
    assert not unexplained, (
        f"past {MODULE_LINES} lines (module) or {FUNCTION_LINES} (function), with no "
        f"'{MARK}' paragraph in the docstring saying why:\n" + "\n".join(unexplained)
    )


def test_the_size_rule_reads_the_reason(tmp_path):
    assert _says_one_piece("Does x.\n\nOne piece: the steps share one lock and read in order.")
    assert not _says_one_piece("Does x.\n\nOne piece:")
    assert not _says_one_piece("Does x. One piece: in the middle of a paragraph.")
    assert not _says_one_piece(None)
