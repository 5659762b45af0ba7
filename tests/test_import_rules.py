"""The layers' import rules (docs/architecture.md §Layout and import names, §Where things live), read from the source
with `ast` so a violation fails here, not in review. Every import counts, function-local ones included (they run too).

The floors, bottom first; a layer imports from tinkerflow only the layers this table allows it (and itself):

    protocol     workflows/protocol/   nothing: the stdlib and temporalio only (workflow code, shared by every layer)
    workflows    workflows/            protocol; the stdlib and temporalio only (replayed: no jax, numpy or I/O)
    common       platform/common/      protocol (settings, store, checkpoints, errors: the API's and workers' floor)
    engine       workers/engine/       common (the JAX engine knows nothing of Temporal, its protocol or activities)
    activities   activities/           protocol, common, engine (the JAX worker's activities drive the engine)
    api          platform/api/         protocol, common, workflows (it starts and queries the workflows by type)
    processes    workers/*.py          protocol, common, workflows, engine, activities (the worker processes)
    cli          platform/cli/         everything: it is the launcher that starts every process kind. The one rule
                                       on it: it reaches the JAX side (activities/, workers/) only through a process's
                                       entry point, imported inside the command that runs it, so `tinkerflow api`,
                                       `up` and `usage` never load JAX.

So protocol < workflows, common < engine < activities < processes < cli, with api beside activities (above common
and workflows, below cli).

Inside the engine, its floors (ENGINE_FLOORS, bottom first): the vocabulary (types.py, interface.py,
shape_buckets.py) < model/ < runtime/ < training/ < sampling/ < the engine as a whole (engine.py, warm_up.py,
engine_lock.py, multihost.py); and its modules import each other without a cycle.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
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


def _violations(folder: str, allowed: Callable[[str], bool], exclude: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(exclude):
            continue
        bad += [f"{rel}:{line} imports {mod}" for line, mod in _imports(path) if not allowed(mod)]
    return bad


def _top(mod: str) -> str:
    return mod.split(".")[0]


# Each layer: its folder, the folders inside it that are other layers, and the import prefix that names it. The most
# specific prefix is matched first (workflows.protocol before workflows, workers.engine before workers).
LAYERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "protocol": ("workflows/protocol", (), "tinkerflow.workflows.protocol"),
    "workflows": ("workflows", ("workflows/protocol/",), "tinkerflow.workflows"),
    "common": ("platform/common", (), "tinkerflow.common"),
    "engine": ("workers/engine", (), "tinkerflow.workers.engine"),
    "activities": ("activities", (), "tinkerflow.activities"),
    "api": ("platform/api", (), "tinkerflow.api"),
    "processes": ("workers", ("workers/engine/",), "tinkerflow.workers"),
    "cli": ("platform/cli", (), "tinkerflow.cli"),
}
FLOORS: dict[str, set[str]] = {
    "protocol": set(),
    "workflows": {"protocol"},
    "common": {"protocol"},
    "engine": {"common"},
    "activities": {"protocol", "common", "engine"},
    "api": {"protocol", "common", "workflows"},
    "processes": {"protocol", "common", "workflows", "engine", "activities"},
}
# Workflow code is replayed: anything beyond the standard library and temporalio is a determinism or sandbox risk.
STDLIB_AND_TEMPORALIO_ONLY = {"protocol", "workflows"}


def layer_of(mod: str) -> str | None:
    """The layer a tinkerflow module belongs to (None for anything outside tinkerflow)."""
    for name, (_, _, prefix) in sorted(LAYERS.items(), key=lambda kv: -len(kv[1][2])):
        if mod == prefix or mod.startswith(prefix + "."):
            return name
    return None


def _floor_allows(layer: str, mod: str) -> bool:
    if _top(mod) == "tinkerflow":
        return layer_of(mod) in FLOORS[layer] | {layer}
    if layer in STDLIB_AND_TEMPORALIO_ONLY:
        return _top(mod) in sys.stdlib_module_names or _top(mod) == "temporalio"
    return True


def test_the_layers_cover_every_folder_of_code():
    # A folder that is in no layer is held to no rule: adding one means placing it in the table above.
    code = [p for d in ("workflows", "platform", "activities", "workers") for p in (REPO / d).rglob("*.py")]
    folders = {p.parent.relative_to(REPO).as_posix() for p in code}
    roots = [folder for folder, _, _ in LAYERS.values()]
    assert sorted(f for f in folders if not any(f == r or f.startswith(r + "/") for r in roots)) == []


@pytest.mark.parametrize("layer", list(FLOORS))
def test_each_layer_imports_only_the_floors_below_it(layer):
    folder, exclude, _ = LAYERS[layer]
    assert _violations(folder, lambda mod: _floor_allows(layer, mod), exclude) == []


# What the launcher may start, by module: the two worker processes, the tiny model `make-tiny-model` writes, and the
# model resolver `up` checks --base-model with before it starts any part (config.json only, no JAX).
ENTRY_POINTS = {
    "tinkerflow.workers.jax_worker",
    "tinkerflow.workers.base_model",
    "tinkerflow.workers.workflow_worker",
    "tinkerflow.workers.engine.model.tiny_model",
}


def _jax_side_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, inside a function) for each import of activities/ or workers/; `from tinkerflow.workers import
    jax_worker` names the module tinkerflow.workers.jax_worker."""
    tree = ast.parse(path.read_text(), str(path))
    local = {
        id(inner)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parent = node.module
            mods = [f"{parent}.{alias.name}" if parent == "tinkerflow.workers" else parent for alias in node.names]
        else:
            continue
        found += [
            (node.lineno, m, id(node) in local) for m in mods if layer_of(m) in ("activities", "engine", "processes")
        ]
    return found


def test_the_cli_reaches_the_jax_side_only_through_an_entry_point_inside_its_command():
    folder = REPO / LAYERS["cli"][0]
    bad = [
        f"{path.relative_to(REPO).as_posix()}:{line} imports {mod}" + ("" if local else " at module level")
        for path in sorted(folder.rglob("*.py"))
        for line, mod, local in _jax_side_imports(path)
        if mod not in ENTRY_POINTS or not local
    ]
    assert bad == []


def test_the_launcher_does_start_the_jax_side():
    """The rule above is not vacuous: the CLI does import the workers' entry points (if it ever stops, say by starting
    them as `python -m`, tighten the cli row of the table instead)."""
    folder = REPO / LAYERS["cli"][0]
    seen = {mod for path in folder.rglob("*.py") for _, mod, _ in _jax_side_imports(path)}
    assert {"tinkerflow.workers.jax_worker", "tinkerflow.workers.workflow_worker"} <= seen


@pytest.mark.parametrize(
    "layer, source, expected",
    [
        ("workflows", "import jax\n", ["x.py:1 imports jax"]),
        ("workflows", "def f():\n    import numpy\n", ["x.py:2 imports numpy"]),
        ("workflows", "from tinkerflow.common import store\n", ["x.py:1 imports tinkerflow.common"]),
        ("workflows", "from . import names\nimport asyncio\nfrom tinkerflow.workflows.protocol import work\n", []),
        (
            "protocol",
            "from tinkerflow.workflows.session import SessionWorkflow\n",
            ["x.py:1 imports tinkerflow.workflows.session"],
        ),
        ("common", "from tinkerflow.workflows.protocol.messages import BlobRef\nimport numpy\n", []),
        (
            "common",
            "from tinkerflow.workflows.requester import CoordinatorCalls\n",
            ["x.py:1 imports tinkerflow.workflows.requester"],
        ),
        (
            "engine",
            "from tinkerflow.workflows.protocol import messages\n",
            ["x.py:1 imports tinkerflow.workflows.protocol"],
        ),
        (
            "activities",
            "from tinkerflow.workers.accelerator import AcceleratorMeter\n",
            ["x.py:1 imports tinkerflow.workers.accelerator"],
        ),
        ("activities", "from tinkerflow.workers.engine.types import Datum\n", []),
        ("api", "from tinkerflow.workers.engine import model\n", ["x.py:1 imports tinkerflow.workers.engine"]),
        ("processes", "from tinkerflow.api.app import create_app\n", ["x.py:1 imports tinkerflow.api.app"]),
    ],
)
def test_the_rule_checker_sees_violations(tmp_path, monkeypatch, layer, source, expected):
    # The checker itself must fail on what it forbids; a rule test that passes on everything proves nothing.
    folder = tmp_path / LAYERS[layer][0]
    folder.mkdir(parents=True)
    (folder / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = _violations(LAYERS[layer][0], lambda mod: _floor_allows(layer, mod))
    assert [v.removeprefix(LAYERS[layer][0] + "/") for v in found] == expected


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from tinkerflow.workers import jax_worker\n", [(1, "tinkerflow.workers.jax_worker", False)]),
        ("def f():\n    from tinkerflow.workers import jax_worker\n", [(2, "tinkerflow.workers.jax_worker", True)]),
        ("def f():\n    from tinkerflow.activities import wire\n", [(2, "tinkerflow.activities", True)]),
        ("from tinkerflow.api.app import create_app\n", []),
    ],
)
def test_the_cli_checker_sees_where_an_import_is(tmp_path, source, expected):
    (tmp_path / "x.py").write_text(source)
    assert _jax_side_imports(tmp_path / "x.py") == expected


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


# The engine's floors, bottom first, by the first name under workers/engine ("": its __init__): a module imports only
# its own floor and those below. The model does not know how it is trained or sampled; training and sampling place
# their arrays by the model's sharding and compile through runtime's caches; sampling reads training's adapter
# slots (snapshots) and its token checks; the top composes them all.
ENGINE_FLOORS: tuple[tuple[str, ...], ...] = (
    ("types", "interface", "shape_buckets"),
    ("model",),
    ("runtime",),
    ("training",),
    ("sampling",),
    ("", "engine", "engine_parts", "warm_up", "engine_lock", "multihost"),
)


def _engine_floor(module: str) -> int:
    first = module.removeprefix(ENGINE).lstrip(".").split(".")[0]
    for floor, names in enumerate(ENGINE_FLOORS):
        if first in names:
            return floor
    raise AssertionError(f"{module} is on no floor of ENGINE_FLOORS: put {first!r} on one")


def test_the_engine_floors_import_only_downward():
    graph = _import_graph(REPO / "workers" / "engine", ENGINE)
    upward = [
        f"{m} imports {t}" for m in sorted(graph) for t in sorted(graph[m]) if _engine_floor(t) > _engine_floor(m)
    ]
    assert upward == []


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
        (
            {
                "sub/__init__.py": "",
                "sub/c.py": "from ..a import y\n",
                "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.sub import c\n",
            },
            [["p.a", "p.sub.c"]],
        ),
        ({"a.py": "from .b import x\n", "b.py": "import numpy\nfrom . import c\n", "c.py": ""}, []),
    ],
)
def test_the_cycle_checker_sees_cycles(tmp_path, files, expected):
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    (tmp_path / "__init__.py").write_text("")
    assert _cycles(_import_graph(tmp_path, "p")) == expected
