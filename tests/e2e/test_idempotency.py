"""Retries over raw HTTP, as the SDK's holder layer sends them: same seq_id + same body = one execution, same answer;
same seq_id + different body = 409."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_forward_backward_output

pytestmark = pytest.mark.e2e


def _result(http: httpx.Client, request_id: str, proto: bool = False) -> Any:
    for _ in range(40):
        r = http.post(
            "/api/v1/retrieve_future",
            json={"request_id": request_id, "allow_metadata_only": False},
            headers={"Accept": "application/x-protobuf"} if proto else {},
            timeout=60,
        )
        r.raise_for_status()
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return r.content
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError("future never resolved")


def test_retried_seq_id_runs_once_and_a_reused_one_gets_409(stack, base_model):
    http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": stack.api_key})
    session_id = http.post(
        "/api/v1/create_session",
        json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
    ).json()["session_id"]
    created = http.post(
        "/api/v1/create_model",
        json={
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": base_model,
            "lora_config": {"rank": 4},
            "type": "create_model",
        },
    ).json()
    model_id = created["model_id"]
    assert _result(http, created["request_id"])["model_id"] == model_id

    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6, 7, 8], np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.array([6, 7, 8, 9], np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[4])
    )
    body = msg.SerializeToString()
    headers = {"Content-Type": "application/x-protobuf"}
    first = http.post("/api/v1/forward_backward", content=body, headers=headers).json()["request_id"]
    again = http.post("/api/v1/forward_backward", content=body, headers=headers).json()["request_id"]
    assert first == again
    out = deserialize_forward_backward_output(_result(http, first, proto=True))
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 4
    # After the answer, a retry still names the same future, and the run has not moved past seq 1.
    assert http.post("/api/v1/forward_backward", content=body, headers=headers).json()["request_id"] == first

    def optim(lr: float) -> httpx.Response:
        return http.post(
            "/api/v1/optim_step",
            json={
                "model_id": model_id,
                "seq_id": 2,
                "type": "optim_step",
                "adam_params": {
                    "learning_rate": lr,
                    "beta1": 0.9,
                    "beta2": 0.95,
                    "eps": 1e-12,
                    "weight_decay": 0.0,
                    "grad_clip_norm": 0.0,
                },
            },
        )

    ok = optim(1e-4)
    assert ok.status_code == 200
    assert "metrics" in _result(http, ok.json()["request_id"])
    conflict = optim(5e-4)
    assert conflict.status_code == 409 and "seq_id 2" in conflict.json()["detail"]

    run = http.post("/api/v1/get_info", json={"model_id": model_id, "type": "get_info"}).json()
    assert run["model_id"] == model_id
