"""Bad input gets a clear error and loses nothing: each case, then the same client still trains."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e


def _datum(tokens, targets=None, weights=None):
    targets = tokens[1:] + [tokens[0]] if targets is None else targets
    weights = [1.0] * len(targets) if weights is None else weights
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=tokens),
        loss_fn_inputs=dict(target_tokens=targets, weights=weights),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )


GOOD = _datum([10, 20, 30, 40, 50])


def _still_trains(training_client) -> None:
    out = training_client.forward_backward([GOOD], "cross_entropy").result(timeout=300)
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 5
    assert "loss:sum" in out.metrics
    training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=300)


def _failed_future(future) -> tinker.RequestFailedError:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=300)
    assert info.value.category == "user" or str(info.value.category).endswith("user")
    return info.value


def test_unknown_base_model_is_rejected(service_client):
    with pytest.raises(tinker.BadRequestError, match="unknown base_model"):
        service_client.create_lora_training_client(base_model="nobody/no-such-model").result()


def test_wrong_api_key_gets_401(stack, base_model):
    client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-not-the-key")
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        client.create_lora_training_client(base_model=base_model).result()


def test_unknown_loss_fails_the_future_and_the_client_keeps_working(training_client):
    err = _failed_future(training_client.forward_backward([GOOD], "no_such_loss"))
    assert "no_such_loss" in str(err)
    _still_trains(training_client)


def test_out_of_vocab_tokens_fail_the_future(training_client, stack):
    err = _failed_future(training_client.forward_backward([_datum([1, 2, 10**6, 3])], "cross_entropy"))
    assert "1000000" in str(err)
    err = _failed_future(training_client.forward_backward([_datum([1, 2, 3], targets=[5, -1, 7])], "cross_entropy"))
    assert "target_tokens" in str(err)
    _still_trains(training_client)


def test_mismatched_lengths_fail_the_future(training_client):
    err = _failed_future(
        training_client.forward_backward(
            [_datum([1, 2, 3, 4], targets=[2, 3, 4, 5], weights=[1.0, 1.0])], "cross_entropy"
        )
    )
    assert "weights" in str(err)
    _still_trains(training_client)


def test_corrupt_and_truncated_protobuf_bodies_get_400_with_a_body(stack, training_client):
    import httpx
    from tinker.proto import tinker_public_pb2 as pb

    url = f"{stack.base_url}/api/v1/forward_backward"
    headers = {"X-API-Key": stack.api_key, "Content-Type": "application/x-protobuf"}
    r = httpx.post(url, content=b"\xff\xff\xff\xff garbage", headers=headers)
    assert r.status_code == 400 and "protobuf" in r.json()["detail"]

    msg = pb.ForwardBackwardRequest(model_id=training_client.model_id, seq_id=10**6, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = np.arange(64, dtype=np.int32).tobytes()
    body = msg.SerializeToString()
    r = httpx.post(url, content=body[: len(body) - 7], headers=headers)
    assert r.status_code == 400 and r.json()["detail"]

    r = httpx.post(url, content=b"not zstd", headers={**headers, "Content-Encoding": "zstd"})
    assert r.status_code == 400 and "zstd" in r.json()["detail"]
    _still_trains(training_client)


def test_unknown_model_id_gets_404(stack):
    import httpx

    r = httpx.post(
        f"{stack.base_url}/api/v1/optim_step",
        headers={"X-API-Key": stack.api_key},
        json={
            "model_id": "sess-nope:train:0",
            "seq_id": 1,
            "type": "optim_step",
            "adam_params": {
                "learning_rate": 1e-4,
                "beta1": 0.9,
                "beta2": 0.95,
                "eps": 1e-12,
                "weight_decay": 0.0,
                "grad_clip_norm": 0.0,
            },
        },
    )
    assert r.status_code == 404 and "sess-nope:train:0" in r.json()["detail"]
