"""The layers' import rules (docs/architecture.md §The workflows, §Layout and import names), read from the source with
`ast` so a violation fails here, not in review.

- `platform/` (the API, CLI and common code) never imports the JAX side: `tinkerflow.activities` or
  `tinkerflow.workers`.
  The CLI is the one exception: it is the entry point that starts every process kind, the JAX worker included.
- `workflows/` imports only the standard library, temporalio and itself (workflow code is replayed; anything else is a
  determinism or sandbox risk).
- `platform/common` (the bottom layer) imports neither the engine nor the API.
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
