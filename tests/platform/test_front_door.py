"""The README is a front door a stranger can walk through: short, its SDK loop short and complete (the e2e test
tests/e2e/test_readme.py runs it), and nothing a newcomer reads or runs points outside this repository."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

README = REPO / "README.md"
STANDS_ALONE = ["README.md", "scripts", "docs", "platform", "workflows", "activities", "workers"]


def readme_loop() -> str:
    """The README's python block that trains and samples: the one a newcomer copies."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    loops = [b for b in blocks if "forward_backward" in b]
    assert len(loops) == 1, f"expected one python block with the training loop, found {len(loops)}"
    return loops[0]


def test_readme_fits_a_front_door():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_loop_is_complete_and_short():
    loop = readme_loop()
    assert len(loop.strip().splitlines()) <= 20
    for call in ("forward_backward(", "optim_step(", "save_weights_and_get_sampling_client(", ".sample("):
        assert call in loop, call
    # The SDK's deprecated spelling (a FutureWarning at every run); RestClient's is the current one.
    assert "ServiceClient().get_server_capabilities" not in loop and "service.get_server_capabilities" not in loop


def test_nothing_points_outside_the_repository():
    found = subprocess.run(
        ["git", "grep", "--untracked", "-n", "-I", r"\.\./shared", "--", *STANDS_ALONE],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    assert not found, f"references to files beside the checkout:\n{found}"
