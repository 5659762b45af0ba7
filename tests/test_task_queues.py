"""Tests that start Temporal workers outside the real stack each use a task queue of their own (wf_harness.
unique_queue): a fixed queue shared by two tests lets a leftover workflow, timer or activity of one reach the other's
worker. The real stack (tests/e2e) runs its own Temporal per stack and uses the production queue names."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

FIXED_QUEUE = re.compile(r"WORKFLOW_TASK_QUEUE|task_queue\s*=\s*[\"']")


def test_no_test_outside_e2e_names_a_fixed_task_queue():
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("tests/e2e/") or path == Path(__file__):
            continue
        found += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if FIXED_QUEUE.search(line)]
    assert found == []


def test_the_check_sees_a_fixed_queue():
    assert FIXED_QUEUE.search('Worker(client, task_queue="tinkerflow-workflows")')
    assert FIXED_QUEUE.search("task_queue=names.WORKFLOW_TASK_QUEUE")
    assert not FIXED_QUEUE.search("task_queue=unique_queue()")
