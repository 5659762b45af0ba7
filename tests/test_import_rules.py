"""The layers' import rules (docs/architecture.md §The workflows, §Layout and import names), read from the source with
`ast` so a violation fails here, not in review.

- `platform/` (the API, CLI and common code) never imports the JAX side: `tinkerflow.activities` or
  `tinkerflow.workers`.
  The CLI is the one exception: it is the entry point that starts every process kind, the JAX worker included.
- `workflows/` imports only the standard library, temporalio and itself (workflow code is replayed; anything else is a
  determinism or sandbox risk).
- `platform/common` (the bottom layer) imports neither the engine nor the API.
- The engine's modules (`workers/engine/`) import each other without a cycle, counting every import: at the top, inside
  functions and under `TYPE_CHECKING` alike (a cycle hidden in a function still ties the two modules together).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module a file imports, with its line; function-local imports included (they run too)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(folder: str, allowed, exclude: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(exclude):
            continue
        bad += [f"{rel}:{line} imports {mod}" for line, mod in _imports(path) if not allowed(mod)]
    return bad


def _top(mod: str) -> str:
    return mod.split(".")[0]


def test_platform_does_not_import_the_jax_side():
    def allowed(mod: str) -> bool:
        return not mod.startswith(("tinkerflow.activities", "tinkerflow.workers"))

    assert _violations("platform", allowed, exclude=("platform/cli/",)) == []


def test_common_imports_neither_engine_nor_api():
    def allowed(mod: str) -> bool:
        return not mod.startswith(("tinkerflow.activities", "tinkerflow.workers", "tinkerflow.api", "tinkerflow.cli"))

    assert _violations("platform/common", allowed) == []


def test_workflows_import_only_stdlib_temporalio_and_themselves():
    def allowed(mod: str) -> bool:
        return (
            _top(mod) in sys.stdlib_module_names
            or _top(mod) == "temporalio"
            or mod == "tinkerflow.workflows"
            or mod.startswith("tinkerflow.workflows.")
        )

    assert _violations("workflows", allowed) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import jax\n", ["x.py:1 imports jax"]),
        ("from tinkerflow.workers.engine import model\n", ["x.py:1 imports tinkerflow.workers.engine"]),
        ("def f():\n    import numpy\n", ["x.py:2 imports numpy"]),
        ("from . import names\nimport asyncio\n", []),
    ],
)
def test_the_rule_checker_sees_violations(tmp_path, monkeypatch, source, expected):
    # The checker itself must fail on what it forbids; a rule test that passes on everything proves nothing.
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)

    def allowed(mod: str) -> bool:
        return _top(mod) in sys.stdlib_module_names or mod.startswith("tinkerflow.workflows")

    assert [v.removeprefix("workflows/") for v in _violations("workflows", allowed)] == expected


ENGINE = "tinkerflow.workers.engine"


def _package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module under `root` by its import name, `root` being the folder of `package` (a package by __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return modules


def _import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (relative or absolute, anywhere in the file)."""
    modules = _package_modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                # `from X import y` imports the module X.y when there is one, else X itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # an attribute of a module, or a module outside the package
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_engine_modules_import_each_other_without_a_cycle():
    graph = _import_graph(REPO / "workers" / "engine", ENGINE)
    assert graph.get(f"{ENGINE}.engine"), "no engine import found: did the engine move?"
    assert _cycles(graph) == []


@pytest.mark.parametrize(
    "files, expected",
    [
        # a hidden cycle: one side imports the other inside a function
        ({"a.py": "from .b import x\n", "b.py": "def f():\n    from . import a\n"}, [["p.a", "p.b"]]),
        # through a sub-package, absolute one way and relative the other, one side under TYPE_CHECKING
        ({"sub/__init__.py": "", "sub/c.py": "from ..a import y\n",
          "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.sub import c\n"},
         [["p.a", "p.sub.c"]]),
        ({"a.py": "from .b import x\n", "b.py": "import numpy\nfrom . import c\n", "c.py": ""}, []),
    ],
)  # fmt: skip
def test_the_cycle_checker_sees_cycles(tmp_path, files, expected):
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    (tmp_path / "__init__.py").write_text("")
    assert _cycles(_import_graph(tmp_path, "p")) == expected
