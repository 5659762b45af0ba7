# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""The tiny Qwen3.5 through the unmodified SDK against the real stack, served under a hub id as a local copy
(`--served-model-name Qwen/Qwen3.5-4B`, with an empty Hugging Face cache: nothing is fetched): the README loop
(forward_backward + optim_step) learns, forward logprobs equal the engine's, and a sampling client samples through
the hybrid state cache with the logprobs its `compute_logprobs` gives the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.conftest import QWEN3_5_HUB_ID as HUB_ID

pytestmark = pytest.mark.e2e
TOKENS = [5, 17, 42, 99, 3, 250, 7, 11, 64, 2, 9, 1500, 33]


def _datum(tinker, tokens):
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _engine_logprobs(model) -> np.ndarray:
    """The base model's logprobs of TOKENS from the engine in this process (a fresh LoRA is the base model)."""
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig

    engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.create_adapter(0, LoraConfig(rank=8))
    datum = Datum(tokens=np.asarray(TOKENS[:-1], np.int32), inputs={"target_tokens": np.asarray(TOKENS[1:], np.int32)})
    [res] = engine.forward_backward(
        [ForwardBackwardInput(slot=0, data=[datum], loss_fn="cross_entropy", forward_only=True)]
    )
    assert not isinstance(res, Exception), res
    return res.outputs[0]["logprobs"]


def test_trains_under_the_hub_id_and_forward_equals_the_engine(qwen3_5_stack, qwen3_5_model):
    import tinker

    s, model = qwen3_5_stack, qwen3_5_model
    client = tinker.ServiceClient(base_url=s.base_url, api_key=s.api_key)
    assert [m.model_name for m in client.get_server_capabilities().supported_models] == [HUB_ID]
    training = client.create_lora_training_client(base_model=HUB_ID, rank=8)
    forward = training.forward([_datum(tinker, TOKENS)], "cross_entropy").result()
    got = np.asarray(forward.loss_fn_outputs[0]["logprobs"].tolist(), np.float32)
    np.testing.assert_allclose(got, _engine_logprobs(model), atol=1e-4, rtol=1e-4)
    losses = []
    for _ in range(6):
        fb = training.forward_backward([_datum(tinker, TOKENS)], "cross_entropy")
        training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        losses.append(-float(np.sum(fb.result().loss_fn_outputs[0]["logprobs"].tolist())))
    assert losses[-1] < 0.5 * losses[0], losses


def test_samples_with_the_logprobs_compute_logprobs_gives(qwen3_5_stack):
    import tinker

    s = qwen3_5_stack
    client = tinker.ServiceClient(base_url=s.base_url, api_key=s.api_key)
    sampler = client.create_sampling_client(base_model=HUB_ID)
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    seq = sampler.sample(tinker.ModelInput.from_ints(TOKENS), 1, params).result().sequences[0]
    assert len(seq.tokens) >= 1 and seq.logprobs is not None
    whole = tinker.ModelInput.from_ints([*TOKENS, *seq.tokens])
    scored = sampler.compute_logprobs(whole).result()
    # As tests/engine/test_qwen3_5_engine.py: the recurrent decode step against the chunked form, float32.
    np.testing.assert_allclose(seq.logprobs, np.asarray(scored[len(TOKENS) :], float), atol=5e-5)
