"""Dimuon through the unmodified SDK: `create_lora_training_client(optimizer=DimuonOptimizerConfig())` with
`DimuonParams` steps, its state through save_state and the two ways back (with the optimizer: the very same next step;
weights only: the optimizer the new client names), and every mismatch a clear user error that loses nothing.
The numerics against the documented formula are tests/engine/test_dimuon.py's."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.test_tenancy_routes import _poll

pytestmark = pytest.mark.e2e

LR = 0.05  # docs/optimizers.md: the tiny model's starting point
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10 + i, 26 + i))),
        loss_fn_inputs=dict(target_tokens=list(range(11 + i, 27 + i))),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    for i in range(4)
]


def _loss(client) -> float:
    return client.forward(DATA, "cross_entropy").result(timeout=300).metrics["loss:sum"]


def _step(client, params) -> dict:
    client.forward_backward(DATA, "cross_entropy").result(timeout=300)
    return client.optim_step(params).result(timeout=300).metrics


def _failed(future) -> str:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=300)
    assert str(info.value.category).endswith("user")
    return str(info.value)


@pytest.fixture(scope="module")
def dimuon_client(service_client, base_model):
    return service_client.create_lora_training_client(
        base_model=base_model, rank=8, optimizer=types.DimuonOptimizerConfig()
    ).result(timeout=300)


def test_dimuon_trains_and_keeps_its_state_through_save_state(stack, service_client, dimuon_client):
    first = _loss(dimuon_client)
    for _ in range(3):
        metrics = _step(dimuon_client, types.DimuonParams(learning_rate=LR, grad_clip_norm=10.0))
    assert metrics["tinkerflow/learning_rate"] == LR and metrics["tinkerflow/adapter_optim_steps"] == 3
    assert _loss(dimuon_client) < 0.8 * first

    path = dimuon_client.save_state("dimuon-3").result(timeout=300).path
    rest = tinker.RestClient(base_url=stack.base_url, api_key=stack.api_key)
    saved = rest.get_weights_info_by_tinker_path(path).result().optimizer_config  # the SDK parses it generically
    assert saved.model_dump() == types.DimuonOptimizerConfig().model_dump() == {"type": "dimuon", "version": 1}

    # With the optimizer: the momentum comes back, so one more step lands where the original's does.
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result(timeout=300)
    for client in (dimuon_client, resumed):
        _step(client, types.DimuonParams(learning_rate=LR))
    original = dimuon_client.forward(DATA, "cross_entropy").result(timeout=300)
    restored = resumed.forward(DATA, "cross_entropy").result(timeout=300)
    for a, b in zip(original.loss_fn_outputs, restored.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=0, atol=1e-6)

    # Weights only: the new client's own optimizer, AdamW unless it names another.
    as_adam = service_client.create_training_client_from_state(path).result(timeout=300)
    assert "needs AdamParams" in _failed(as_adam.optim_step(types.DimuonParams(learning_rate=LR)))
    _step(as_adam, types.AdamParams(learning_rate=1e-3))
    again = service_client.create_training_client_from_state(path, optimizer=types.DimuonOptimizerConfig())
    _step(again.result(timeout=300), types.DimuonParams(learning_rate=LR))


def test_the_other_familys_params_fail_the_future_and_change_nothing(training_client, dimuon_client):
    before = _loss(dimuon_client)
    dimuon_client.forward_backward(DATA, "cross_entropy").result(timeout=300)
    message = _failed(dimuon_client.optim_step(types.AdamParams(learning_rate=1e-3)))
    assert "created with optimizer 'dimuon'" in message and "needs DimuonParams" in message
    assert _loss(dimuon_client) == before
    _step(dimuon_client, types.DimuonParams(learning_rate=LR))  # the run goes on

    message = _failed(training_client.optim_step(types.DimuonParams(learning_rate=LR)))
    assert "created with optimizer 'adamw'" in message and "needs AdamParams" in message


def test_what_the_sdk_cannot_send_is_refused_by_name(stack, base_model, service_client):
    """A newer SDK's DimuonParams fields are honoured; unknown fields, unknown families and bad values are refused,
    naming them, and an in-sequence op still takes its seq_id (the run goes on). Raw HTTP on a run of its own: the
    SDK client whose ids it borrows sends nothing itself afterwards."""
    rest = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": stack.api_key}, timeout=120)
    session = service_client.holder.get_session_id()
    r = rest.post(
        "/api/v1/create_model",
        json={
            "session_id": session,
            "model_seq_id": 900,
            "base_model": base_model,
            "optimizer_config": {"type": "lion"},
        },
    )
    assert r.status_code == 400 and "optimizer_config type 'lion' is not supported" in r.json()["detail"]
    r = rest.post(
        "/api/v1/create_model",
        json={
            "session_id": session,
            "model_seq_id": 901,
            "base_model": base_model,
            "optimizer_config": {"type": "dimuon", "version": 2},
        },
    )
    assert r.status_code == 400 and "version must be 1" in r.json()["detail"]

    client = service_client.create_lora_training_client(
        base_model=base_model, rank=4, optimizer=types.DimuonOptimizerConfig()
    ).result(timeout=300)
    model = client.model_id

    def seq() -> int:  # the run's next seq_id (the SDK sends its reserved request id + 1)
        return client._get_request_id() + 1

    for params, problem in [
        ({"type": "dimuon", "learning_rate": LR, "momentum": 0.9}, "unknown fields ['momentum']"),
        ({"type": "dimuon", "learning_rate": LR, "damping": 0.0}, "damping must be > 0"),
        ({"type": "sgd", "learning_rate": LR}, "type 'sgd' is not supported"),
    ]:
        body = {"model_id": model, "seq_id": seq(), "optimizer_params": params, "type": "optim_step"}
        r = rest.post("/api/v1/optim_step", json=body)
        assert r.status_code == 200, r.text
        outcome = _poll(rest, r.json()["request_id"])
        assert outcome["category"] == "user" and problem in outcome["error"], outcome
    newer = {"type": "dimuon", "learning_rate": LR, "damping": 0.5, "rank_lr_correction_exponent": 0}
    body = {"model_id": model, "seq_id": seq(), "type": "optim_step", "optimizer_params": newer}
    r = rest.post("/api/v1/optim_step", json=body)
    outcome = _poll(rest, r.json()["request_id"])
    assert outcome["metrics"]["tinkerflow/learning_rate"] == LR, outcome
