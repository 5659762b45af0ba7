"""OpenAI-compatible endpoint, without a stack: token pieces, stop-sequence cuts, and request validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tinkerflow.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    first_error,
)
from tinkerflow.api.openai_render import Rendered, echo_logprobs, render, token_pieces


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from tinkerflow.workers.engine.model.tiny_tokenizer import EOS_TOKEN, build_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False
    )


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_pieces_join_to_the_text_and_each_ascii_token_is_its_own_piece(tokenizer, text):
    tokens = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, tokens)
    assert len(pieces) == len(tokens) and "".join(pieces) == tokenizer.decode(tokens)
    if text.isascii():  # byte-level BPE: an ASCII token decodes on its own
        assert pieces == [tokenizer.decode([t]) for t in tokens]


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=2044), min_size=1, max_size=16))
def test_pieces_of_any_token_sequence_join_to_its_decode(tokenizer, ids):
    # What a random-weight model samples: byte tokens that end inside a character, invalid UTF-8, special tokens.
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_multibyte_character_split_over_tokens_is_emitted_once(tokenizer):
    tokens = tokenizer.encode("naïve 🦊 fox")
    pieces = token_pieces(tokenizer, tokens)
    assert "".join(pieces) == "naïve 🦊 fox" and not any("\ufffd" in p for p in pieces)


def test_render_cuts_at_the_first_stop_sequence_and_keeps_pieces_and_logprobs_aligned(tokenizer):
    tokens = tokenizer.encode("one two three four")
    r = render(tokenizer, tokens, [-0.5] * len(tokens), "length", ["four", " thr"])
    assert r.text == "one two" and r.finish_reason == "stop" and "".join(r.pieces) == "one two"
    assert len(r.logprobs) == len(r.pieces) and r.completion_tokens == len(tokens)
    untouched = render(tokenizer, tokens, None, "length", ["zzz"])
    assert untouched.text == "one two three four" and untouched.finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m"}, "prompt"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_bad_completion_parameters_are_named(body, param):
    with pytest.raises(Exception) as e:
        CompletionRequest.model_validate(body)
    assert isinstance(e.value, ValidationError), e.value
    err = first_error(e.value)
    assert (err.status, err.param) == (400, param)


def _first_unsupported(request: CompletionRequest | ChatCompletionRequest) -> str:
    unsupported = request.unsupported()
    assert unsupported is not None
    return unsupported[0]


def test_unsupported_parameters_are_refused_not_ignored():
    assert _first_unsupported(CompletionRequest(model="m", prompt="x", echo=True, stream=True)) == "echo"
    assert _first_unsupported(CompletionRequest(model="m", prompt="x", logprobs=2)) == "logprobs"
    assert _first_unsupported(CompletionRequest(model="m", prompt="x", max_tokens=0)) == "max_tokens"
    assert CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True, logprobs=2).unsupported() is None
    assert CompletionRequest(model="m", prompt="x", logprobs=0).unsupported() is None
    # model_validate: the messages are given as the JSON dicts a client sends; pydantic validates them as ChatMessage.
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1.0}
    )
    assert _first_unsupported(chat) == "presence_penalty"
    parts = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        }
    )
    assert parts.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]


def test_echo_logprobs_put_the_prompt_scores_before_the_completion(tokenizer):
    prompt = tokenizer.encode("one two three")
    completion = render(tokenizer, tokenizer.encode(" four"), [-0.25], "length", None)
    scores = [-1.0 - i for i in range(len(prompt) - 1)]
    lps: list[float | None] = [None, *scores]
    topk: list[list[tuple[int, float]] | None] = [None] + [
        [(prompt[i + 1], scores[i]), (7, -9.0)] for i in range(len(prompt) - 1)
    ]
    out = echo_logprobs(tokenizer, prompt, lps, topk, completion)
    assert "".join(out["tokens"]) == "one two three four"
    assert out["token_logprobs"] == [*lps, -0.25]
    assert out["top_logprobs"][0] is None and out["top_logprobs"][-1] == {}
    second = tokenizer.decode([prompt[1]])
    assert out["top_logprobs"][1][second] == lps[1]  # what lm-eval-harness compares for is_greedy
    assert out["text_offset"][0] == 0 and out["text_offset"][-1] == len("one two three")
    empty = echo_logprobs(tokenizer, prompt, lps, None, Rendered("", [], [], "length", 0))
    assert empty["top_logprobs"] is None and len(empty["tokens"]) == len(prompt)
