# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""The shared acceptance loops, unchanged, through the unmodified SDK against the real stack serving the tiny
Qwen3-MoE (routed experts, LoRA on attention and experts): Pig Latin SFT and the RL loop."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import API_KEY, run_acceptance_script
from tinkerflow.cli.launch import RunningStack, launch
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def moe_stack(tmp_path_factory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("e2e-moe")
    model = make_tiny_model(root / "tiny-qwen3-moe", family="qwen3_moe")
    s = launch(root / "state", api_key=API_KEY, extra=["--base-model", str(model), "--max-lora-adapters", "8"])
    yield s
    s.stop()


def test_serves_the_moe_model(moe_stack):
    import tinker

    client = tinker.ServiceClient(base_url=moe_stack.base_url, api_key=moe_stack.api_key)
    names = [m.model_name for m in client.get_server_capabilities().supported_models]
    assert names == [moe_stack.served_model()] and names[0].endswith("tiny-qwen3-moe")


def test_pig_latin_on_moe(moe_stack):
    run_acceptance_script(moe_stack, "pig_latin.py", timeout_s=1200)


@pytest.mark.slow
def test_rl_loop_on_moe(moe_stack, request):
    # Slow: only with TINKERFLOW_SLOW_TESTS=1 or `-m slow`, as the engine's slow tests.
    if os.environ.get("TINKERFLOW_SLOW_TESTS") != "1" and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow e2e test: set TINKERFLOW_SLOW_TESTS=1 to run")
    run_acceptance_script(moe_stack, "rl_loop.py", timeout_s=1500)
