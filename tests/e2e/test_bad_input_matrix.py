"""The bad-input matrix on the real stack: each answered clearly, and the same client keeps training."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.test_bad_input import _datum, _failed_future, _still_trains

pytestmark = pytest.mark.e2e


def test_sequences_longer_than_the_context_fail_the_future(training_client):
    long = list(np.random.default_rng(0).integers(10, 1000, size=2049))  # the tiny model's context is 2048
    err = _failed_future(training_client.forward_backward([_datum(long)], "cross_entropy"))
    assert "max_position_embeddings" in str(err)
    _still_trains(training_client)


def test_nan_and_inf_in_weights_or_advantages_fail_the_future(training_client):
    err = _failed_future(
        training_client.forward_backward([_datum([1, 2, 3], weights=[1.0, math.nan, 1.0])], "cross_entropy")
    )
    assert "weights" in str(err)
    rl = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs=dict(  # pyright: ignore[reportArgumentType] (Datum converts lists)
            target_tokens=[2, 3, 4], logprobs=[-1.0, -1.0, -1.0], advantages=[0.5, math.inf, 0.5]
        ),
    )
    err = _failed_future(training_client.forward_backward([rl], "importance_sampling"))
    assert "advantages" in str(err)
    _still_trains(training_client)


def test_zero_length_sequence_fails_the_future(training_client):
    empty = types.Datum(model_input=types.ModelInput.from_ints([]), loss_fn_inputs=dict(target_tokens=[], weights=[]))  # pyright: ignore[reportArgumentType] (Datum converts lists)
    err = _failed_future(training_client.forward_backward([empty], "cross_entropy"))
    assert "datum 0: model_input is empty" in str(err)
    _still_trains(training_client)


def test_sampling_parameters_out_of_range_fail_the_future(service_client, base_model):
    sampler = service_client.create_sampling_client(base_model=base_model).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    err = _failed_future(
        sampler.sample(prompt=prompt, num_samples=0, sampling_params=types.SamplingParams(max_tokens=4))
    )
    assert "num_samples" in str(err)
    err = _failed_future(
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=-3))
    )
    assert "max_tokens" in str(err)
    ok = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result(
        timeout=300
    )
    assert len(ok.sequences[0].tokens) == 2


def test_unknown_sampler_malformed_path_and_rank_over_the_limit(stack, service_client, base_model):
    http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": stack.api_key})
    r = http.post(
        "/api/v1/asample",
        json={
            "num_samples": 1,
            "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 2},
            "sampling_session_id": "sess-nobody:sample:0",
            "seq_id": 0,
            "type": "sample",
        },
    )
    assert r.status_code == 404 and r.json()["detail"]
    with pytest.raises(tinker.BadRequestError, match="malformed; expected tinker://<run>/<kind>/<name>"):
        service_client.create_sampling_client(model_path="tinker://x").result()
    with pytest.raises(tinker.BadRequestError, match="rank 64 is outside"):
        service_client.create_lora_training_client(base_model=base_model, rank=64).result()


def test_oversized_body_gets_413_with_a_body(stack, training_client):
    r = httpx.post(
        f"{stack.base_url}/api/v1/forward_backward",
        content=b"\0" * 5_000_000,
        headers={"X-API-Key": stack.api_key, "Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["detail"]
    _still_trains(training_client)
