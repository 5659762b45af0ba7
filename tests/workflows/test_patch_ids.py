"""Patch ids follow the house rule `<area>-<what>-v<n>` (workflows/README.md), read from the source with `ast`.

The ids below came before the rule and stay as they are: recorded histories (tests/replay) and running workflows
hold them in their markers, and renaming one would make those take the other branch. A new id that breaks the
rule fails here."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

RULE = re.compile(r"^[a-z]+(-[a-z0-9]+)+-v[0-9]+$")
BEFORE_THE_RULE = {
    "age-encrypted-external-weights",
    "coordinator-fail-batch-of-restarted-worker",
    "coordinator-fair-order",
    "run-metrics-tags",
    "run-recover-again-after-worker-lost",
    "sample-work",
}


def patch_ids() -> list[tuple[str, str]]:
    """(file, id) for every `workflow.patched(...)` / `workflow.deprecate_patch(...)` in workflows/."""
    found = []
    for path in sorted((REPO / "workflows").rglob("*.py")):  # the coordinator/ package too
        tree = ast.parse(path.read_text())
        constants = {
            t.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            for t in node.targets
            if isinstance(t, ast.Name) and isinstance(node.value.value, str)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("patched", "deprecate_patch")
                and node.args
            ):
                arg = node.args[0]
                value = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", ""))
                name = path.relative_to(REPO).as_posix()
                assert isinstance(value, str), f"{name}:{node.lineno}: a patch id must be a literal or constant"
                found.append((name, value))
    return found


def test_patch_ids_follow_the_house_rule():
    ids = patch_ids()
    assert ids, "no patch ids found: the reader is broken"
    wrong = [f"{f}: {i}" for f, i in ids if not RULE.match(i) and i not in BEFORE_THE_RULE]
    assert not wrong, f"patch ids must read <area>-<what>-v<n>: {wrong}"


def test_the_ids_from_before_the_rule_are_still_in_use():
    ids = [i for _, i in patch_ids()]
    assert set(ids) >= BEFORE_THE_RULE, "an id listed as before the rule is no longer used: drop it from the list"
