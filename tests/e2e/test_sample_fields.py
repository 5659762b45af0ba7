"""Every SampleRequest field and the sampling session's batch routes through the unmodified SDK against the stack:
each value checked against the trainer's forward log-probs at 1e-4 (the sampler/trainer parity tolerance: float32
sums in different orders), the prefix cache counted, the stop rule, inflight clients, and each route's tenant
checks. All of it runs with the SDK's retrieve_futures poller, which /client/config turns on."""

from __future__ import annotations

import pickle

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.e2e.conftest import OTHER_API_KEY

pytestmark = pytest.mark.e2e
ATOL = 1e-4
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11, 60, 8, 19, 23, 71, 44, 2, 9, 31, 12, 88, 64, 101, 6]


@pytest.fixture(scope="module")
def sampler(service_client, base_model):
    return service_client.create_sampling_client(base_model=base_model).result()


@pytest.fixture(scope="module")
def base_trainer(service_client, base_model):
    """A fresh LoRA (B = 0): its forward log-probs are the base model's."""
    return service_client.create_lora_training_client(base_model=base_model, rank=4).result()


def _datum(tokens: list[int], targets) -> types.Datum:
    target = types.TensorData.from_numpy(np.asarray(targets, np.int64))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": target})


def forward_logprobs(trainer, tokens: list[int], targets: np.ndarray) -> np.ndarray:
    """The trainer's log-probs of targets[i] (one id or [K] ids) after tokens[: i + 1]."""
    datum = _datum(tokens[:-1], targets)
    out = trainer.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_topk_sample_logprobs(sampler, base_trainer):
    res = sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        2,
        types.SamplingParams(max_tokens=5, seed=1, stop=[]),
        topk_sample_logprobs=3,
    ).result()
    for seq in res.sequences:
        top = seq.topk_logprobs_np
        assert top is not None and top.token_ids.shape == (5, 3)
        full = PROMPT + seq.tokens
        ids = top.token_ids.astype(np.int64)
        ref = forward_logprobs(base_trainer, full, np.concatenate([np.zeros((len(PROMPT) - 1, 3), np.int64), ids]))
        np.testing.assert_allclose(top.logprobs, ref[len(PROMPT) - 1 :], atol=ATOL)
        assert np.all(np.diff(top.logprobs, axis=1) <= 0)


@pytest.mark.parametrize("sparse", [False, True])
def test_target_prompt_logprobs_dense_and_csr(sampler, base_trainer, sparse):
    ids = torch.full((len(PROMPT) - 1, 2), -1, dtype=torch.int64)
    ids[3] = torch.tensor([10, 11])
    ids[-1, 0] = 200
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1) if sparse else types.TensorData.from_torch(ids)
    res = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=target
    ).result()
    got = res.target_prompt_logprobs
    assert got is not None and got.dtype == "float32" and (got.sparse_crow_indices is not None) == sparse
    ref = forward_logprobs(base_trainer, PROMPT, ids.clamp(min=0).numpy())
    want = np.where(ids.numpy() >= 0, ref, 0.0)
    np.testing.assert_allclose(got.to_numpy(), want, atol=ATOL)


def test_prompt_alt_tokens_k(sampler, base_trainer):
    res = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=3), prompt_alt_tokens_k=2
    ).result()
    alt = res.prompt_alt_tokens
    assert alt is not None and alt.tokens.shape == [len(PROMPT) - 1, 2]
    ref = forward_logprobs(base_trainer, PROMPT, alt.tokens.to_numpy())
    np.testing.assert_allclose(alt.logprobs.to_numpy(), ref, atol=ATOL)


def test_prompt_logprobs_last_n(sampler, base_trainer):
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=4).result()
    assert logprobs[:-4] == [None] * (len(PROMPT) - 4)
    ref = forward_logprobs(base_trainer, PROMPT, np.array(PROMPT[1:]))
    np.testing.assert_allclose(logprobs[-4:], ref[-4:], atol=ATOL)


def test_record_stability_info_samples_with_logprobs(service_client, base_model):
    client = service_client.create_sampling_client(base_model=base_model, record_stability_info=True).result()
    res = client.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, stop=[])).result()
    assert all(len(s.logprobs or []) == 4 and s.sequence_id for s in res.sequences)


def test_a_field_beyond_its_limit_is_a_user_error_naming_it(sampler):
    with pytest.raises(tinker.RequestFailedError, match="topk_sample_logprobs must be in"):
        sampler.sample(
            types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1), topk_sample_logprobs=500
        ).result()


def test_prefix_cache_hits_within_a_session_only(service_client, base_model):
    sampler = service_client.create_sampling_client(base_model=base_model).result()
    long = PROMPT * 3  # 66 tokens: four whole blocks
    group = sampler.sample(types.ModelInput.from_ints(long), 16, types.SamplingParams(max_tokens=4, seed=2)).result()
    again = sampler.sample(types.ModelInput.from_ints(long), 1, types.SamplingParams(max_tokens=4, seed=2)).result()
    assert group.prompt_cache_hit_tokens == 0 and again.prompt_cache_hit_tokens == 64
    assert again.sequences[0].tokens == group.sequences[0].tokens
    np.testing.assert_allclose(again.sequences[0].logprobs, group.sequences[0].logprobs, atol=1e-5)
    other = service_client.create_sampling_client(base_model=base_model).result()
    fresh = other.sample(types.ModelInput.from_ints(long), 1, types.SamplingParams(max_tokens=4, seed=2)).result()
    assert fresh.prompt_cache_hit_tokens == 0


def test_a_stop_string_still_stops_at_eos(sampler):
    eos = sampler.get_tokenizer().eos_token_id
    params = types.SamplingParams(max_tokens=48, temperature=1.5, stop=["]\n"], seed=4)
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 16, params).result()
    for seq in res.sequences:
        assert eos not in seq.tokens[:-1]
        if seq.tokens[-1] == eos:
            assert seq.stop_reason == "stop"


def test_inflight_clients_sample_the_newest_weights(service_client, base_model):
    trainer = service_client.create_lora_training_client(base_model=base_model, rank=4)
    snapshot = trainer.save_weights_and_get_sampling_client().result()
    first = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    datum = _datum(PROMPT[:-1], PROMPT[1:])
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
    second = trainer.save_weights_and_get_sampling_client(kind="inflight").result()

    def prompt_lp(client):
        return np.array(client.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:], float)

    np.testing.assert_allclose(prompt_lp(first), prompt_lp(second), atol=1e-5)
    assert np.abs(prompt_lp(first) - prompt_lp(snapshot)).max() > 1e-2  # the snapshot kept the old weights
    assert first._sampling_session_id != second._sampling_session_id  # a fresh session (KV namespace) per save


def _post(stack, route: str, body: dict, key: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60)


def test_join_sampling_session_numbers_clones_and_checks_the_tenant(stack, sampler):
    clone = pickle.loads(pickle.dumps(sampler))
    res = clone.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
    assert clone._cloned_sampler_id and clone._cloned_sampler_id >= 1 and len(res.sequences) == 1
    body = {"sampling_session_id": sampler._sampling_session_id, "type": "join_sampling_session"}
    a, b = (_post(stack, "join_sampling_session", body, stack.api_key).json()["client_counter"] for _ in range(2))
    assert b == a + 1 and a > clone._cloned_sampler_id
    assert _post(stack, "join_sampling_session", body, OTHER_API_KEY).status_code == 404


def test_retrieve_futures_reports_completions_and_checks_the_tenant(stack, sampler):
    sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
    target = {"type": "sampling_session", "sampling_session_id": sampler._sampling_session_id, "cloned_sampler_id": 0}
    ok = _post(stack, "retrieve_futures", {"target": target, "prev_cursor": 0, "timeout": 0}, stack.api_key)
    assert ok.status_code == 200 and isinstance(ok.json()["cursor"], int)
    other = _post(stack, "retrieve_futures", {"target": target, "prev_cursor": 0, "timeout": 0}, OTHER_API_KEY)
    assert other.status_code == 404


def test_cancel_future(stack, service_client, base_model, sampler):
    """A training op's future cannot be cancelled (400 saying why); another tenant's id is 404; a sample cancelled
    while queued fails as cancelled, category user (one that already ran is left finished)."""
    session_id = service_client.holder.get_session_id()
    model = {
        "session_id": session_id,
        "model_seq_id": 900,
        "base_model": base_model,
        "lora_config": {"rank": 1},
        "type": "create_model",
    }
    training_id = _post(stack, "create_model", model, stack.api_key).json()["request_id"]
    refused = _post(stack, "cancel_future", {"request_id": training_id}, stack.api_key)
    assert refused.status_code == 400 and "cannot be cancelled" in refused.json()["detail"]
    body = {
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": PROMPT, "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 2},
        "sampling_session_id": sampler._sampling_session_id,
        "seq_id": 7_000_000_001,
        "type": "sample",
    }
    busy = {**body, "sampling_params": {"max_tokens": 120, "stop": []}, "num_samples": 8}
    assert all(
        _post(stack, "asample", {**busy, "seq_id": 7_000_000_100 + i}, stack.api_key).status_code == 200
        for i in range(3)
    )
    submitted = _post(stack, "asample", body, stack.api_key).json()["request_id"]
    assert _post(stack, "cancel_future", {"request_id": submitted}, OTHER_API_KEY).status_code == 404
    assert _post(stack, "cancel_future", {"request_id": submitted}, stack.api_key).status_code == 200
    outcome: dict = {"type": "try_again"}
    while outcome.get("type") == "try_again":
        answer = _post(stack, "retrieve_future", {"request_id": submitted}, stack.api_key)
        outcome = answer.json() if answer.headers["content-type"].startswith("application/json") else {"ran": True}
    assert outcome == {"ran": True} or ("cancelled" in outcome["error"] and outcome["category"] == "user")
