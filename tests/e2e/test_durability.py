"""DESIGN §6 on the real parts, each its own process: kill one, start it again, and nothing the SDK was told is lost.

The parts are started with the same machinery as `tinkerflow up` (one process each), so a test can kill exactly one.
"""

from __future__ import annotations

import signal

import pytest
import tinker
from tinker import types

from tinkerflow.cli.launch import free_port
from tinkerflow.cli.up import Stack
from tinkerflow.common.settings import Settings

pytestmark = pytest.mark.e2e
DATUM = types.Datum(model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
                    loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0, 1.0, 1.0, 1.0]))
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture
def parts(tmp_path):
    temporal_port = free_port()
    settings = Settings(state_dir=tmp_path / "state", port=free_port(), api_keys=("tml-durable",),
                        temporal_address=f"127.0.0.1:{temporal_port}")
    stack = Stack(settings)
    stack.temporal_port = temporal_port
    try:
        stack.start_temporal(temporal_port, 0, headless=True)
        stack.start_worker("workflow-worker")
        stack.start_worker("jax-worker")
        stack.start_api()
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack):
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    training = service.create_lora_training_client(base_model=stack.served_model(), rank=4).result()
    training.forward_backward([DATUM], "cross_entropy").result(timeout=300)  # compiles before any fault
    training.optim_step(ADAM).result(timeout=300)
    return training


def _losses(futures) -> list[float]:
    return [f.result(timeout=300).metrics["loss:sum"] for f in futures]


def test_api_killed_and_restarted_mid_run_every_future_resolves(parts):
    training = _client(parts)
    futures = [training.forward_backward([DATUM], "cross_entropy") for _ in range(3)]
    optim = training.optim_step(ADAM)
    parts.kill("api")
    parts.start_api()
    assert len(_losses(futures)) == 3
    assert optim.result(timeout=300).metrics is not None  # a failed future would raise here
    # and the run goes on: seq order intact, the next step lowers the loss on this datum
    before = _losses([training.forward_backward([DATUM], "cross_entropy")])[0]
    training.optim_step(ADAM).result(timeout=300)
    after = _losses([training.forward_backward([DATUM], "cross_entropy")])[0]
    assert after < before


def test_workflow_worker_killed_only_delays(parts):
    training = _client(parts)
    futures = [training.forward_backward([DATUM], "cross_entropy") for _ in range(2)]
    parts.kill("workflow-worker")
    parts.start_worker("workflow-worker")
    assert len(_losses(futures)) == 2
    assert training.optim_step(ADAM).result(timeout=300) is not None


def test_temporal_restarted_on_its_file_keeps_sessions_runs_and_futures(parts):
    training = _client(parts)
    done = training.forward_backward([DATUM], "cross_entropy")
    first = _losses([done])[0]
    parts.kill("temporal", signal.SIGTERM)
    parts.start_temporal(parts.temporal_port, 0, headless=True)
    # the answered future is still answerable, and the same training client keeps training in order
    assert _losses([done])[0] == first
    assert len(_losses([training.forward_backward([DATUM], "cross_entropy")])) == 1
    assert training.optim_step(ADAM).result(timeout=300) is not None
