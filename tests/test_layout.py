"""Module and class size caps, read from the source with `ast`: no module over 400 lines, no class over 300.

A module that outgrows the cap is split by concern (a new module named for what it holds), a class by responsibility;
never squeezed under it with `# fmt: skip`. Test modules are held to the same caps: one that grows past them holds
more than one concern (helpers beside the tests, two setups), and splits the same way.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from tests.conftest import REPO

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
# Folders under the repository root that hold no source of ours (environments, build output, caches).
NOT_SOURCE = {"build", "typings", "node_modules"}
# Over a cap today and being split by work in progress; an entry goes once its split lands (the last test says when).
KNOWN_OVER: set[str] = set()
# Formatter markers (comments that turn ruff format off for a line or a block) hand-lay code it would lay out. Only
# the settings' field tables keep them: one field per entry (name, default, help, flag group) reads as a table when
# aligned. Nothing else may gain one.
KNOWN_SQUEEZED = ("platform/common/settings_",)


def _source_files() -> list[Path]:
    def skipped(path: Path) -> bool:
        first = path.relative_to(REPO).parts[0]
        return first in NOT_SOURCE or first.startswith(".") or first.endswith(".egg-info")

    return sorted(p for p in REPO.rglob("*.py") if not skipped(p))


def _over_the_caps(rel: str, text: str) -> list[str]:
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{rel}: {lines} lines (cap {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, rel)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            size = node.end_lineno - node.lineno + 1
            if size > MAX_CLASS_LINES:
                found.append(f"{rel}: class {node.name} is {size} lines (cap {MAX_CLASS_LINES})")
    return found


def test_the_walk_finds_the_source():
    top = {p.relative_to(REPO).parts[0] for p in _source_files()}
    assert {"activities", "benchmarks", "platform", "tests", "workers", "workflows"} <= top


def test_no_module_or_class_is_over_its_cap():
    files = {p.relative_to(REPO).as_posix(): p for p in _source_files()}
    over = [f for rel, p in files.items() if rel not in KNOWN_OVER for f in _over_the_caps(rel, p.read_text())]
    assert over == [], "split by concern (modules) or responsibility (classes): " + "; ".join(over)


def test_each_known_exception_is_still_over():
    # Once a listed module is within the caps, its entry goes, so the set only shrinks.
    within = sorted(rel for rel in KNOWN_OVER if not _over_the_caps(rel, (REPO / rel).read_text()))
    assert within == [], f"within the caps now, remove from KNOWN_OVER: {within}"


def _formatter_markers(rel: str, text: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [
        f"{rel}:{t.start[0]}"
        for t in tokens
        if t.type == tokenize.COMMENT and ("fmt: skip" in t.string or "fmt: off" in t.string)
    ]


def test_no_formatter_markers_outside_the_known_files():
    files = {p.relative_to(REPO).as_posix(): p for p in _source_files()}
    found = [
        m
        for rel, p in files.items()
        if not rel.startswith(KNOWN_SQUEEZED)
        for m in _formatter_markers(rel, p.read_text())
    ]
    assert found == [], "let ruff format lay these out (split the module if it then passes the cap): " + ", ".join(
        found
    )


def test_the_marker_check_sees_a_comment_and_not_prose():
    text = 'x = [1,  2]  # fmt: skip\n"""fmt: skip in a docstring is prose"""\n'
    assert _formatter_markers("a.py", text) == ["a.py:1"]


def test_the_check_sees_an_oversized_module_and_class():
    body = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "\n" * (MAX_MODULE_LINES - MAX_CLASS_LINES)
    assert _over_the_caps("big.py", body) == [
        f"big.py: {MAX_MODULE_LINES + 1} lines (cap {MAX_MODULE_LINES})",
        f"big.py: class Big is {MAX_CLASS_LINES + 1} lines (cap {MAX_CLASS_LINES})",
    ]
    assert _over_the_caps("small.py", "class Small:\n    x = 1\n") == []
