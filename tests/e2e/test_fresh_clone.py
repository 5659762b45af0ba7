"""A stranger's first command works: the repository cloned into an empty folder with nothing beside it, where
`bash scripts/demo.sh` sets up its own .venv, brings the stack up and says the model learned, with no packaging
warning on the way (on its output, or in the setup log it keeps pip's output in).

What is cloned is this checkout's HEAD: commit before running it locally. The clone's setup installs from the
package registries as a stranger's would (pip reuses the machine's wheel cache, as on any machine that installed
these packages before). Two things differ from a stranger's run, both for a shared CI host: the ports come from
TINKERFLOW_* variables (free ones, since other stacks may run beside this one), and no other TINKERFLOW_* variable
of the test session (its shared XLA compilation cache) reaches the clone, which compiles everything itself."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.conftest import REPO
from tinkerflow.cli.launch import free_port

pytestmark = pytest.mark.e2e
PACKAGING_WARNINGS = ("BuildBackendWarning", "would be ignored", "SetuptoolsDeprecationWarning", "Editable install")


def test_demo_runs_from_a_bare_clone_and_the_model_learns(tmp_path_factory):
    empty = tmp_path_factory.mktemp("stranger")
    clone = empty / "tinkerflow"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    assert sorted(p.name for p in empty.iterdir()) == ["tinkerflow"]  # nothing beside it: no ../shared

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKERFLOW_", "VIRTUAL_ENV"))}
    env.update(TINKERFLOW_PORT=str(free_port()), TINKERFLOW_TEMPORAL_PORT=str(free_port()))
    env.update(TINKERFLOW_UI_PORT=str(free_port()))
    started = time.monotonic()
    run = subprocess.run(["bash", "scripts/demo.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - started
    out = run.stdout + run.stderr
    log = clone / ".tinkerflow" / "setup.log"
    assert run.returncode == 0, f"exit {run.returncode} after {took:.0f} s\n{out}"
    assert "demo: the model learned" in run.stdout, out
    assert "Learned: 'coding wizard' → 'oding-cay izard-way'" in run.stdout, out
    for warning in PACKAGING_WARNINGS:
        assert warning not in out, f"{warning!r} in the demo's output:\n{out}"
        assert warning not in log.read_text(), f"{warning!r} in {log}"
    # It never names a link to the stack it has stopped, only how to bring it back.
    assert "To see its runs in the console:" in out and "then open http://" in out
    print(f"fresh clone: setup and demo in {took:.0f} s")
