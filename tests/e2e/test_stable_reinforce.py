"""`record_stability_info` and `stable_reinforce` through the unmodified SDK against the stack: a sampler made with
record_stability_info records each sampled sequence, and a stable_reinforce forward_backward whose datums name their
sequences in provenance spans (built as tinker_cookbook's rl_loop builds them) is held to the record: the loss uses
the sampler's recorded log-probs, a token that is not what was sampled is refused, and so is a sequence with no
record, whether it was sampled without record_stability_info or by another tenant (the same answer for both). Each
refusal fails only its own future, as a user error naming the datum, the sequence and what to do; the run goes on."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import OTHER_API_KEY

pytestmark = pytest.mark.e2e
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11, 60, 8, 19, 23, 71, 44, 2, 9, 31, 12, 88, 64, 101, 6]
PARAMS = types.SamplingParams(max_tokens=6, stop=[], seed=3, temperature=1.0)
NO_RECORD = "which has no stability record in this session"


@pytest.fixture(scope="module")
def trainer(service_client, base_model):
    return service_client.create_lora_training_client(base_model=base_model, rank=4).result()


@pytest.fixture(scope="module")
def sampled(trainer) -> types.SampleResponse:
    """Two samples from the trainer's weights, recorded (what rl.train and rl_loop do for stable_reinforce)."""
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result()


def datum(seq: types.SampledSequence, advantage: float, *, tokens=None, logprobs=None, sequence_id=None):
    """rl_loop's stable_reinforce datum: the prompt and all but the last sampled token in; targets shifted by one
    (zeros on the prompt); the sampler's log-probs and the advantage on the sampled tokens; provenance naming the
    sequence for both fields."""
    tokens = list(seq.tokens) if tokens is None else tokens
    logprobs = list(seq.logprobs or []) if logprobs is None else logprobs
    sid = sequence_id or seq.sequence_id
    ob, n = len(PROMPT) - 1, len(tokens)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array([0] * ob + tokens, np.int64)),
            "logprobs": types.TensorData.from_numpy(np.array([0.0] * ob + logprobs, np.float32)),
            "advantages": types.TensorData.from_numpy(np.array([0.0] * ob + [advantage] * n, np.float32)),
        },
    )
    return d.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob),
            types.SampledProvenanceSpan(sequence_id=sid, length=n),
        ],
    )


def refused(future, *patterns: str) -> str:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=300)
    assert str(info.value.category).endswith("user"), info.value
    for pattern in patterns:
        assert pattern in str(info.value), info.value
    return str(info.value)


def test_stable_reinforce_trains_on_the_recorded_sequences(trainer, sampled):
    a, b = sampled.sequences
    assert a.sequence_id and b.sequence_id and len(a.tokens) == len(b.tokens) == 6
    data = [datum(a, 1.0), datum(b, -1.0)]
    out = trainer.forward(data, "stable_reinforce").result()
    # On the sampler's own weights the ratio is 1 within the sampler/trainer parity (1e-4), so the loss is
    # -sum(A * lp) over the sampled tokens, lp the trainer's log-probs that forward answers.
    ob = len(PROMPT) - 1
    lps = [o["logprobs"].to_numpy()[ob:] for o in out.loss_fn_outputs]
    for seq, lp in zip(sampled.sequences, lps):
        np.testing.assert_allclose(lp, seq.logprobs, atol=1e-4)
    expected = -(lps[0].sum() - lps[1].sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3, abs=1e-3)
    # The loss reads the record, not the datum: log-probs nudged within the tolerance give the very same loss.
    nudged = [datum(a, 1.0, logprobs=[x + 5e-5 for x in a.logprobs or []]), datum(b, -1.0)]
    assert trainer.forward(nudged, "stable_reinforce").result().metrics["loss:sum"] == out.metrics["loss:sum"]
    fb = trainer.forward_backward(data, "stable_reinforce").result()
    assert fb.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()


def test_what_the_record_contradicts_is_refused_and_the_run_goes_on(trainer, sampled):
    a = sampled.sequences[0]
    wrong = list(a.tokens)
    wrong[3] = (wrong[3] + 1) % 2000
    ob = len(PROMPT) - 1
    refused(
        trainer.forward_backward([datum(a, 1.0, tokens=wrong)], "stable_reinforce"),
        "datum 0: ",
        f"is {wrong[3]} but sequence {a.sequence_id!r} sampled {a.tokens[3]}",
    )
    off = [x - 0.5 for x in a.logprobs or []]
    refused(
        trainer.forward_backward([datum(a, 1.0, logprobs=off)], "stable_reinforce"),
        f"datum 0: logprobs[{ob}] is",
        "but the sampler recorded",
    )
    trainer.forward_backward([datum(a, 1.0)], "stable_reinforce").result()  # the next op of the run is served


def test_a_sequence_sampled_without_record_stability_info_is_refused(service_client, base_model, trainer):
    plain = service_client.create_sampling_client(base_model=base_model).result()
    seq = plain.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]
    refused(
        trainer.forward_backward([datum(seq, 1.0)], "stable_reinforce"),
        f"names sequence {seq.sequence_id!r}, {NO_RECORD}",
        "record_stability_info=True",
    )


def test_another_tenants_sequence_is_refused_like_a_missing_one(stack, base_model, trainer, sampled):
    other = tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER_API_KEY)
    theirs_sampler = other.create_sampling_client(base_model=base_model, record_stability_info=True).result()
    theirs = theirs_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]
    # Their tokens and log-probs, under their sequence id: still no record in this session.
    message = refused(trainer.forward_backward([datum(theirs, 1.0)], "stable_reinforce"), NO_RECORD)
    unknown = theirs.sequence_id.rsplit("#", 1)[0] + "#99"  # a sequence of theirs that does not exist
    missing = refused(trainer.forward_backward([datum(theirs, 1.0, sequence_id=unknown)], "stable_reinforce"))
    # Word for word, but for the id (the SDK's text around our message names each request).
    said = [
        m[m.index("datum 0") : m.index("importance_sampling")].replace(i, "<id>")
        for m, i in ((message, theirs.sequence_id), (missing, unknown))
    ]
    assert said[0] == said[1]
    # And they cannot train on ours either.
    mine = sampled.sequences[0]
    their_trainer = other.create_lora_training_client(base_model=base_model, rank=4).result()
    refused(their_trainer.forward_backward([datum(mine, 1.0)], "stable_reinforce"), NO_RECORD)
