"""Nothing wedges: an in-sequence op with a bad body fails through its own future, every result is
answerable, and each bad input the issue lists is answered clearly; after each, the same client trains on."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.test_bad_input import GOOD, _failed_future, _still_trains

pytestmark = pytest.mark.e2e


def _headers(stack) -> dict[str, str]:
    return {"X-API-Key": stack.api_key}


BAD_ADAM = [
    (dict(learning_rate=float("nan")), "learning_rate"),
    (dict(learning_rate=float("inf")), "learning_rate"),
    (dict(learning_rate=-1e-4), "learning_rate"),
    (dict(weight_decay=-1e6), "weight_decay"),
    (dict(grad_clip_norm=-1.0), "grad_clip_norm"),
    (dict(beta1=1.0), "beta1"),
    (dict(beta2=float("nan")), "beta2"),
    (dict(eps=-1e-8), "eps"),
]


def test_bad_adam_params_fail_their_future_and_the_next_seq_id_runs(training_client):
    """The SDK sends NaN/inf as null: that used to be a 400 at submit, leaving the seq_id unconsumed and every later
    op of the client waiting for it forever."""
    for changes, field in BAD_ADAM:
        err = _failed_future(training_client.optim_step(types.AdamParams(**changes)))
        assert field in str(err), (changes, str(err))
    _still_trains(training_client)


def test_a_step_that_would_make_weights_non_finite_is_refused_and_said_plainly(service_client, base_model):
    training = service_client.create_lora_training_client(base_model=base_model, rank=4).result(timeout=300)
    before = training.save_state("before-blowup").result(timeout=300).path
    training.forward_backward([GOOD], "cross_entropy").result(timeout=300)
    training.optim_step(types.AdamParams(learning_rate=1e30)).result(timeout=300)  # weights ~1e30: still finite
    out = training.forward_backward([GOOD], "cross_entropy").result(timeout=300)  # answerable, whatever it holds
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 5
    err = _failed_future(training.optim_step(types.AdamParams(learning_rate=1e-4)))
    assert "not finite" in str(err) and "load_state" in str(err)
    with pytest.warns(Warning):  # the SDK marks load_state deprecated
        training.load_state(before).result(timeout=300)
    _still_trains(training)


def test_a_sampler_weights_path_is_refused_for_training(service_client, training_client):
    path = training_client.save_weights_for_sampler("not-a-state").result(timeout=300).path
    with pytest.raises(tinker.RequestFailedError, match="sampler_weights checkpoint") as e:
        service_client.create_training_client_from_state(path).result(timeout=300)
    assert str(e.value.category).lower().endswith("user")
    _still_trains(training_client)


def test_a_seq_id_far_ahead_is_refused_at_submit_and_the_client_goes_on(stack, training_client):
    r = httpx.post(
        f"{stack.base_url}/api/v1/optim_step",
        headers=_headers(stack),
        timeout=60,
        json={
            "model_id": training_client.model_id,
            "seq_id": 10_000_000,
            "type": "optim_step",
            "adam_params": {"learning_rate": 1e-4},
        },
    )
    assert r.status_code == 400 and "ahead of the run's next" in r.json()["detail"]
    _still_trains(training_client)


def test_deeply_nested_json_gets_4xx_and_the_api_lives_on(stack, training_client):
    nested = ("[" * 100_000 + "]" * 100_000).encode()
    for route in ("create_session", "optim_step", "create_model", "retrieve_future"):
        body = b'{"user_metadata": ' + nested + b', "model_id": "x", "seq_id": 1}'
        r = httpx.post(
            f"{stack.base_url}/api/v1/{route}",
            content=body,
            timeout=60,
            headers={**_headers(stack), "Content-Type": "application/json"},
        )
        assert 400 <= r.status_code < 500 and r.json()["detail"], (route, r.status_code, r.text[:200])
    _still_trains(training_client)


def test_user_metadata_is_bounded_and_model_seq_id_non_negative(stack, service_client, training_client):
    session_id = training_client.model_id.split(":")[0]
    base = {"session_id": session_id, "base_model": stack.served_model(), "lora_config": {"rank": 4}}
    r = httpx.post(
        f"{stack.base_url}/api/v1/create_model",
        headers=_headers(stack),
        timeout=60,
        json={**base, "model_seq_id": 900, "user_metadata": {"k": "x" * 100_000}},
    )
    assert r.status_code == 400 and "user_metadata" in r.json()["detail"]
    r = httpx.post(
        f"{stack.base_url}/api/v1/create_model", headers=_headers(stack), timeout=60, json={**base, "model_seq_id": -1}
    )
    assert r.status_code == 400 and "model_seq_id" in r.json()["detail"]
    r = httpx.post(
        f"{stack.base_url}/api/v1/create_session",
        headers=_headers(stack),
        timeout=60,
        json={"tags": [], "user_metadata": {"k": "x" * 100_000}, "sdk_version": "0.38.0"},
    )
    assert r.status_code == 400 and "user_metadata" in r.json()["detail"]
    _still_trains(training_client)


def test_ttl_that_is_not_a_whole_number_gets_400(stack, training_client):
    path = training_client.save_state("ttl-target").result(timeout=300).path
    run, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
    url = f"{stack.base_url}/api/v1/training_runs/{run}/checkpoints/{checkpoint_id}/ttl"
    for bad in ("abc", 1e300, 3600.5, True, [1]):
        r = httpx.put(url, headers=_headers(stack), json={"ttl_seconds": bad}, timeout=60)
        assert r.status_code == 400 and "ttl_seconds" in r.json()["detail"], (bad, r.status_code, r.text[:200])
    # 1e400 parses as infinity
    r = httpx.put(
        url,
        headers={**_headers(stack), "Content-Type": "application/json"},
        content=b'{"ttl_seconds": 1e400}',
        timeout=60,
    )
    assert r.status_code == 400 and "ttl_seconds" in r.json()["detail"]
    _still_trains(training_client)


def _raw_request(base_url: str, head: str, body: bytes = b"") -> tuple[int, dict]:
    """Send a request by hand (so a declared length need not be followed by the body) and read the answer."""
    url = urlparse(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as s:
        s.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_bodies_over_a_routes_limit_get_413_before_they_are_read(stack, training_client):
    # A declared 100 MB create_session: answered without a byte of the body sent.
    status, body = _raw_request(
        stack.base_url,
        (
            "POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + stack.api_key
            + "\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        ),
    )
    assert status == 413 and "--max-control-body-bytes" in body["detail"]
    # A chunked body (no length declared) is counted as it streams and cut off at the limit.
    chunk = b'{"x":"' + b"a" * (1 << 20) + b'"}'
    chunked = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    status, body = _raw_request(
        stack.base_url,
        (
            "POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + stack.api_key
            + "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        ),
        chunked,
    )
    assert status == 413 and "limit" in body["detail"]
    _still_trains(training_client)


def test_per_request_sampling_caps_are_clear(service_client, training_client):
    sampler = training_client.save_weights_and_get_sampling_client().result(timeout=300)
    prompt = types.ModelInput.from_ints(tokens=[1, 2, 3])
    with pytest.raises(tinker.BadRequestError, match="num_samples 20000"):
        sampler.sample(prompt, num_samples=20_000, sampling_params=types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match="max_tokens 1000000"):
        sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1_000_000)).result()
    assert (
        len(
            sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=2))
            .result(timeout=300)
            .sequences
        )
        == 2
    )
    _still_trains(training_client)
