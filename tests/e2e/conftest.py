from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ACCEPTANCE
from tinkerflow.cli.launch import RunningStack, free_port, launch

API_KEY = "tml-e2e-key"
QWEN3_5_HUB_ID = "Qwen/Qwen3.5-4B"  # the id the Qwen3.5 stack serves its tiny local copy under
OTHER_API_KEY = "tml-e2e-other"  # a second tenant on the same stack (tenant isolation tests)
ADMIN_API_KEY = "tml-e2e-operator"  # the operator's key (--admin-api-key): every tenant's usage


@pytest.fixture(scope="session")
def metrics_ports() -> dict[str, int]:
    """The shared stack's other /metrics ports: the JAX worker's (--metrics-port) and `up`'s (--up-metrics-port)."""
    return {"jax-worker": free_port(), "up": free_port()}


@pytest.fixture(scope="session")
def jax_metrics_port(metrics_ports) -> int:
    """The shared stack's JAX worker serves its Prometheus /metrics here (accelerator metrics tests)."""
    return metrics_ports["jax-worker"]


@pytest.fixture(scope="session")
def stack(tmp_path_factory, metrics_ports) -> Iterator[RunningStack]:
    # A 4 MB body limit: far above what the acceptance loops send, low enough to test 413 cheaply.
    # 32 adapter slots: the session's tests open many training clients and leave them to the session's end.
    s = launch(
        tmp_path_factory.mktemp("e2e") / "state",
        api_key=API_KEY,
        extra=[
            *("--max-request-bytes", "4000000", "--max-lora-adapters", "32", "--api-key", OTHER_API_KEY),
            *("--admin-api-key", ADMIN_API_KEY),
            *("--metrics-port", str(metrics_ports["jax-worker"]), "--up-metrics-port", str(metrics_ports["up"])),
        ],
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def qwen3_5_model(tmp_path_factory) -> Path:
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5") / "model", family="qwen3_5", progress=False)


@pytest.fixture(scope="session")
def qwen3_5_stack(tmp_path_factory, qwen3_5_model) -> Iterator[RunningStack]:
    """The tiny Qwen3.5 served as QWEN3_5_HUB_ID (`--served-model-name`, a local copy named by its hub id) with an
    empty Hugging Face cache, so nothing can be fetched: one stack for test_qwen3_5.py and the cookbook's recipes."""
    root = tmp_path_factory.mktemp("e2e-qwen3_5")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_CACHE", str(root / "empty-hub"))  # the stack's environment, copied at its start
        s = launch(
            root / "state",
            api_key=API_KEY,
            extra=["--base-model", str(qwen3_5_model), "--served-model-name", QWEN3_5_HUB_ID, "--warm-up", "off"],
        )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def service_client(stack):
    import tinker

    return tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)


@pytest.fixture(scope="session")
def base_model(stack) -> str:
    return stack.served_model()


@pytest.fixture(scope="session")
def training_client(service_client, base_model):
    return service_client.create_lora_training_client(base_model=base_model, rank=8).result()


def run_acceptance_script(stack: RunningStack, name: str, timeout_s: float) -> None:
    """Run ../shared/acceptance/<name> unchanged against the stack; it must exit 0 and print OK last."""
    script = ACCEPTANCE / name
    if not script.exists():
        pytest.skip(f"{script} not present (shared/ is not beside the repo)")
    # PYTHONFAULTHANDLER: a client that dies of a signal prints every thread's Python stack. A SIGABRT after "OK"
    # was pyqwest's, at interpreter exit; clients now use httpx (tests/e2e/test_transport.py says why).
    env = dict(os.environ, TINKER_API_KEY=stack.api_key, TINKER_TELEMETRY="0", PYTHONFAULTHANDLER="1")
    run = subprocess.run(
        [sys.executable, str(script), stack.base_url], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, f"exit {run.returncode}\n--- stdout\n{run.stdout}--- stderr\n{run.stderr}"
    assert run.stdout.strip().splitlines()[-1] == "OK"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # Any stack the test used (the shared one, or a module's own such as the MoE stack): its parts' logs.
    stacks = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, RunningStack)]
    if report.failed:
        for stack in stacks:
            report.sections.append((f"tinkerflow logs ({stack.state_dir})", stack.logs()))
