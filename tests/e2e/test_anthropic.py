"""The Anthropic-compatible endpoint through the real stack, driven by the real, unmodified `anthropic` package.

A sampler checkpoint is trained with the unmodified tinker SDK to answer one question (after a system prompt) with a
fixed reply and then its end-of-sequence token; the Messages API, given that checkpoint's `tinker://` path as its
`model`, must answer with exactly that reply and `end_turn`. Cross-checks: a conversation's answer equals what the
SDK's own SamplingClient samples (greedy) from the checkpoint on the chat-template-rendered prompt; the streamed text
equals the non-streamed text; count_tokens equals the answer's input_tokens and the rendered prompt's length. Bad
requests are Anthropic-shaped 4xx errors that the SDK raises as its typed exceptions.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from tinker import types

from tests.e2e.conftest import OTHER_API_KEY

pytestmark = pytest.mark.e2e
SYSTEM = "Translate into Pig Latin."
ASK = "hello world"
REPLY = "ello-hay orld-way"
# Temperature 0 is greedy, so an answer is repeatable (the Messages API has no seed); the anthropic SDK has no
# `temperature` argument, so it travels in extra_body.
GREEDY: Any = {"temperature": 0.0}
STEPS = 12


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key=stack.api_key, timeout=600, max_retries=2)


@pytest.fixture(scope="module")
def tokenizer(base_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


def _rendered(tokenizer, turns: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


ASKED = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]


@pytest.fixture(scope="module")
def trained_sampler(service_client, base_model, tokenizer) -> str:
    """A sampler checkpoint that learned to answer ASK, after SYSTEM, with REPLY and then end the sequence: a few
    cross-entropy steps with the SDK on a training client of its own (the shared one stays as other tests expect it),
    then save_weights_for_sampler."""
    training = service_client.create_lora_training_client(base_model=base_model, rank=8).result(timeout=600)
    prompt = _rendered(tokenizer, ASKED)
    answer = tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens, weights = prompt + answer, [0] * len(prompt) + [1] * len(answer)
    inputs: Any = {"target_tokens": tokens[1:], "weights": weights[1:]}
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
    for _ in range(STEPS):
        training.forward_backward([datum], "cross_entropy").result(timeout=600)
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=600)
    return training.save_weights_for_sampler("anthropic-e2e").result(timeout=600).path


def test_a_trained_sampler_path_answers_what_it_learned_and_ends_its_turn(claude, trained_sampler, tokenizer):
    msg = claude.messages.create(
        model=trained_sampler,
        system=SYSTEM,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=16,
        extra_body=GREEDY,
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == trained_sampler
    assert msg.id.startswith("msg_") and _text(msg) == REPLY
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
    assert msg.usage.input_tokens == len(_rendered(tokenizer, ASKED))
    assert msg.usage.output_tokens == len(tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # and the EOS


def test_streamed_text_equals_the_whole_answer(claude, trained_sampler):
    args: dict[str, Any] = {
        "model": trained_sampler,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": ASK}],
        "max_tokens": 16,
        "extra_body": GREEDY,
    }
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    # The raw events, in the order Anthropic sends them.
    events = list(claude.messages.create(**args, stream=True))
    names = [e.type for e in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[2:-3]) == {"content_block_delta"} and len(names) > 6
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == "end_turn"


def test_a_system_prompt_and_several_turns_equal_the_sdk_sampling_the_rendered_prompt(
    claude, service_client, trained_sampler, tokenizer
):
    turns: Any = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": [{"type": "text", "text": "good "}, {"type": "text", "text": "morning"}]},
    ]
    msg = claude.messages.create(
        model=trained_sampler,
        system=[{"type": "text", "text": SYSTEM}],
        messages=turns,
        max_tokens=10,
        extra_body=GREEDY,
    )
    plain = [{"role": "system", "content": SYSTEM}, *turns[:2], {"role": "user", "content": "good morning"}]
    prompt = _rendered(tokenizer, plain)
    sdk = service_client.create_sampling_client(model_path=trained_sampler).result(timeout=600)
    seq = (
        sdk.sample(
            prompt=types.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=10, temperature=0.0),
        )
        .result(timeout=600)
        .sequences[0]
    )
    assert _text(msg) == tokenizer.decode(seq.tokens, skip_special_tokens=True)
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(prompt), len(seq.tokens))
    counted = claude.messages.count_tokens(
        model=trained_sampler,
        system=[{"type": "text", "text": SYSTEM}],
        messages=turns,
    )
    assert counted.input_tokens == len(prompt)


def test_count_tokens_counts_the_rendered_prompt_and_takes_either_key_header(stack, claude, base_model, tokenizer):
    counted = claude.messages.count_tokens(model=base_model, system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == len(_rendered(tokenizer, ASKED))
    # Anthropic's own header: what clients built for api.anthropic.com send (this SDK sends a Bearer token).
    body = {"model": base_model, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]}
    raw = httpx.post(f"{stack.base_url}/v1/messages/count_tokens", json=body, headers={"x-api-key": stack.api_key})
    assert raw.status_code == 200 and raw.json() == {"input_tokens": counted.input_tokens}


def test_stop_sequences_and_max_tokens_say_why_the_answer_ended(claude, trained_sampler):
    asked: Any = {"model": trained_sampler, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]}
    cut = claude.messages.create(**asked, max_tokens=16, stop_sequences=["@@@", "-hay"], extra_body=GREEDY)
    assert _text(cut) == REPLY[: REPLY.index("-hay")]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "-hay")
    short = claude.messages.create(**asked, max_tokens=2, extra_body=GREEDY)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 2)
    assert REPLY.startswith(_text(short))


def test_bad_requests_are_anthropic_shaped_errors_the_sdk_raises_typed(stack, claude, base_model, trained_sampler):
    hello: Any = [{"role": "user", "content": "hello"}]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
                ]
            },
            "does not fetch images",
        ),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
        ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
        ({"max_tokens": 10**6}, "max_tokens"),
    ]
    for extra, named in bad:
        args = {"model": base_model, "messages": hello, "max_tokens": 4, **extra}
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(**args)
        assert _error(e.value)["type"] == "invalid_request_error" and named in _error(e.value)["message"], extra
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", messages=hello, max_tokens=4)
    assert _error(e.value)["type"] == "not_found_error" and "no-such-model" in _error(e.value)["message"]
    # Another tenant's private checkpoint is a 404 naming it, the same as one that does not exist.
    other = anthropic.Anthropic(base_url=stack.base_url, api_key=OTHER_API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        other.messages.create(model=trained_sampler, messages=hello, max_tokens=4)
    assert trained_sampler in _error(e.value)["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model=trained_sampler.replace("anthropic-e2e", "no-such-name"), messages=hello)
    wrong = anthropic.Anthropic(base_url=stack.base_url, api_key="tml-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=base_model, messages=hello, max_tokens=4)
    assert _error(e.value)["type"] == "authentication_error"


def _error(error: anthropic.APIStatusError) -> dict[str, Any]:
    """The error object of an answer; the SDK types `body` as `object`, ours is always Anthropic's error body."""
    assert isinstance(error.body, dict) and error.body["type"] == "error", error.body
    return error.body["error"]


def _text(msg: anthropic.types.Message) -> str:
    """The answer's text: this server answers with exactly one text block."""
    assert len(msg.content) == 1, msg.content
    block = msg.content[0]
    assert block.type == "text", block
    return block.text
