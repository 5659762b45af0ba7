"""The SDK's forward_backward_custom protocol against the real stack: a forward-only pass for logprobs, the user's
loss on the client (torch autograd), then a cross_entropy pass whose weights are -dLoss/dlogprobs."""

from __future__ import annotations

import pytest
from tinker import types

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")


def test_forward_backward_custom_runs_a_client_side_loss(training_client):
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([11, 12, 13, 14]),
            loss_fn_inputs=dict(target_tokens=[12, 13, 14, 15], weights=[0.0, 1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
        )
    ]

    def squared_logprob_loss(batch, logprobs_list):
        loss = sum((lp**2).sum() for lp in logprobs_list)
        return loss, {"custom:sum": float(loss)}

    out = training_client.forward_backward_custom(data, squared_logprob_loss).result(timeout=300)
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert out.metrics["loss:sum"] == pytest.approx(float((logprobs**2).sum()), rel=1e-5)
    assert "surrogate_loss:sum" in out.metrics
    training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
