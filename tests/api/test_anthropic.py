"""The Anthropic-compatible routes without a stack: the request models and what they refuse, the conversion of a
sampled answer into a Message and its stream (checked against the anthropic SDK's own types), the chat-template
rendering count_tokens reports, and hostile bodies, every answer in Anthropic's error shape with a 4xx status."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

import anthropic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from tinkerflow.api import routes_anthropic
from tinkerflow.api.anthropic_wire import (
    AnthropicError,
    MessagesRequest,
    PromptRequest,
    answer_events,
    first_error,
    message,
    stop_reason,
)
from tinkerflow.api.openai_render import Rendered, render
from tinkerflow.api.openai_samplers import OpenAISamplers
from tinkerflow.common.checkpoints import CheckpointNotFound
from tinkerflow.common.settings import Settings
from tinkerflow.workflows.protocol.messages import ModelCard

KEY = "tml-unit"
MODEL = "tiny"
AUTH = {"x-api-key": KEY}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from tinkerflow.workers.engine.model.tiny_tokenizer import CHAT_TEMPLATE, EOS_TOKEN, build_tokenizer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


class _Models:
    """One served model, "tiny" (its tokenizer is preloaded below); no other."""

    async def get(self, name: str):
        return ModelCard(MODEL, "qwen3", "", 2048, 64) if name == MODEL else None


class _NoCheckpoints:
    def readable(self, path: str, who: str):
        raise CheckpointNotFound(f"checkpoint {path} does not exist")


@pytest.fixture(scope="module")
def client(tmp_path_factory, tokenizer) -> TestClient:
    app = FastAPI()
    app.include_router(routes_anthropic.router)
    app.state.services = SimpleNamespace(
        api_keys=(KEY,),
        owner_of=lambda key: "owner",
        registry=_Models(),
        checkpoints=_NoCheckpoints(),
        settings=Settings(state_dir=tmp_path_factory.mktemp("state")),
    )
    app.state.openai_samplers = OpenAISamplers(tokenizers={MODEL: tokenizer})
    return TestClient(app, raise_server_exceptions=False)


def _error(response, status: int) -> dict:
    """The error object of an answer in Anthropic's shape, which the SDK's own ErrorResponse type parses."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["message"]
    if body["error"]["type"] != "request_too_large":  # Anthropic's 413 type, which the SDK's union does not list
        anthropic.types.ErrorResponse.model_validate(body)
    return body["error"]


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, **extra}


# --- the request models -------------------------------------------------------------------------------------------


def test_a_full_request_parses_and_maps_to_the_engines_sampling_parameters():
    req = MessagesRequest.model_validate(
        _body(
            system=[
                {"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "brief."},
            ],
            messages=[*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}, *HELLO],
            stop_sequences=["\n", "User:"],
            temperature=0,
            top_k=5,
            stream=True,
            metadata={"user_id": "u-1"},
        )
    )
    assert req.turns() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "hello"},
    ]
    knobs = req.knobs()
    assert (knobs.temperature, knobs.top_p, knobs.top_k, knobs.stop, knobs.n, knobs.seed) == (
        0.0,
        1.0,
        5,
        ["\n", "User:"],
        1,
        None,
    )
    assert MessagesRequest.model_validate(_body()).knobs().top_k == -1  # unset: no top-k cut
    assert MessagesRequest.model_validate(_body(system="")).turns() == HELLO  # an empty system prompt adds no turn


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": True}, "max_tokens"),  # strict: a bool is not a count
        ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop_sequences": [""]}, "stop_sequences: stop sequences must be non-empty strings"),
        ({"stop_sequences": "\n"}, "stop_sequences"),
        ({"metadata": {"user_id": "u", "team": "x"}}, "metadata.team: this field is not supported here"),
        ({"tools": [{"name": "f", "input_schema": {}}]}, "tools: this parameter is not supported by this server"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: this parameter is not supported"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "of type 'tool_result'"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "without a string `type`"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}]}]}, "citations"),
        ({"messages": [{"role": "user", "content": ""}, *HELLO]}, "messages.0: all messages must have non-empty"),
        ({"system": [{"type": "document"}]}, "system: content blocks of type 'document' are not supported"),
        ({"system": 3}, "system: content must be a string or a list of content blocks"),
    ],
)
def test_what_is_refused_is_named_in_the_message(extra, says):
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({k: v for k, v in _body(**extra).items() if v is not None})
    err = first_error(e.value, list(MessagesRequest.model_fields))
    assert err.status == 400 and err.kind == "invalid_request_error"
    assert says in err.message, err.message


def test_count_tokens_takes_the_prompt_fields_only():
    assert (
        PromptRequest.model_validate({"model": MODEL, "messages": HELLO, "system": "s"}).turns()[0]["role"] == "system"
    )
    with pytest.raises(ValidationError) as e:
        PromptRequest.model_validate({"model": MODEL, "messages": HELLO, "max_tokens": 3})
    assert first_error(e.value, list(PromptRequest.model_fields)).message.startswith("max_tokens: this parameter")


def test_error_types_follow_the_status():
    kinds = {s: AnthropicError(s, "m").kind for s in (400, 401, 403, 404, 409, 413, 429, 500, 503, 529)}
    assert kinds == {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "invalid_request_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        503: "api_error",
        529: "overloaded_error",
    }


# --- answers: stop reasons, the Message, the stream ---------------------------------------------------------------


def test_stop_reasons_say_what_ended_the_answer(tokenizer):
    tokens = tokenizer.encode("one two three four")
    cut = render(tokenizer, tokens, None, "stop", [" four", " thr", "zzz"])
    assert (cut.text, stop_reason(cut)) == ("one two", ("stop_sequence", " thr"))  # the earliest in the text
    assert stop_reason(render(tokenizer, tokens, None, "stop", ["zzz"])) == ("end_turn", None)
    assert stop_reason(render(tokenizer, tokens, None, "length", None)) == ("max_tokens", None)
    # A stop sequence that the whole text reaches only as it ends still counts as the stop sequence.
    assert stop_reason(render(tokenizer, tokens, None, "length", ["four"])) == ("stop_sequence", "four")


def test_the_message_and_its_stream_parse_as_the_sdks_types_and_agree():
    r = Rendered("Hi there", ["Hi", "", " there"], [0.0, 0.0, 0.0], "stop", 4, "\n")
    body = message("msg_1", MODEL, 7, r)
    parsed = anthropic.types.Message.model_validate(body)
    assert parsed.content[0].type == "text" and parsed.content[0].text == "Hi there"
    assert (parsed.stop_reason, parsed.stop_sequence) == ("stop_sequence", "\n")
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (7, 4)

    events = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    names, deltas = [], []
    for raw in answer_events(r):
        name, data = _sse(raw)
        event = events.validate_python(data)
        assert event.type == name
        names.append(name)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            deltas.append(event.delta.text)
        if event.type == "message_delta":
            assert (event.delta.stop_reason, event.delta.stop_sequence, event.usage.output_tokens) == (
                "stop_sequence",
                "\n",
                4,
            )
    assert names == [
        "content_block_start",
        *["content_block_delta"] * 2,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(deltas) == "Hi there"  # empty pieces (a character still incomplete) send no delta


def _sse(raw: str) -> tuple[str, dict[str, Any]]:
    lines = raw.strip("\n").split("\n")
    assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2
    return lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])


def test_a_stream_sends_message_start_then_pings_while_the_engine_works_then_the_answer(monkeypatch):
    monkeypatch.setattr(routes_anthropic, "KEEPALIVE_S", 0.05)
    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL}

    async def slow() -> Rendered:
        await asyncio.sleep(0.3)
        return Rendered("ab", ["a", "b"], [0.0, 0.0], "length", 2)

    async def failing() -> Rendered:
        raise routes_anthropic.OpenAIError(500, "sampling failed: the worker died", None, "server_error")

    async def collect(pending) -> list[tuple[str, dict[str, Any]]]:
        response = routes_anthropic._stream(start, pending)
        return [_sse(cast(str, part)) async for part in response.body_iterator]

    names = [n for n, _ in asyncio.run(collect(slow()))]
    assert names[0] == "message_start" and names[1] == "ping" and names[-1] == "message_stop"
    assert names[names.index("content_block_start") :].count("content_block_delta") == 2
    error = asyncio.run(collect(failing()))
    assert [n for n, _ in error] == ["message_start", "error"]
    assert error[-1][1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "sampling failed: the worker died"},
    }


# --- the routes ---------------------------------------------------------------------------------------------------


def test_keys_models_and_bad_bodies_answer_in_anthropic_shape(client):
    assert _error(client.post("/v1/messages", json=_body()), 401)["type"] == "authentication_error"
    assert _error(client.post("/v1/messages", json=_body(), headers={"x-api-key": "tml-other"}), 401)
    assert _error(client.post("/v1/messages/count_tokens", json={}, headers={"Authorization": "Bearer no"}), 401)
    missing = _error(client.post("/v1/messages", json=_body(model="nope"), headers=AUTH), 404)
    assert missing["type"] == "not_found_error" and "'nope'" in missing["message"]
    path = "tinker://sess-x:train:0/sampler_weights/a"
    private = _error(
        client.post("/v1/messages/count_tokens", json={"model": path, "messages": HELLO}, headers=AUTH), 404
    )
    assert path in private["message"]
    assert (
        _error(client.post("/v1/messages", content=b"{not json", headers=AUTH), 400)["type"] == "invalid_request_error"
    )
    assert _error(client.post("/v1/messages", json=[1, 2], headers=AUTH), 400)
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]
    assert "not fetch" in _error(client.post("/v1/messages", json=_body(messages=image), headers=AUTH), 400)["message"]
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}  # a png's signature
    inline = _body(messages=[{"role": "user", "content": [{"type": "image", "source": png}]}])
    assert "no vision tower" in _error(client.post("/v1/messages", json=inline, headers=AUTH), 400)["message"]
    over = _error(client.post("/v1/messages", json=_body(max_tokens=10**6), headers=AUTH), 400)
    assert over["message"].startswith("max_tokens 1000000 is over this server's limit")
    long = _error(client.post("/v1/messages", json=_body(max_tokens=64), headers=AUTH), 400)  # tiny's context is 64
    assert "context is 64 tokens" in long["message"]


def test_count_tokens_renders_the_conversation_with_the_chat_template(client, tokenizer):
    def count(**body: Any) -> int:
        response = client.post("/v1/messages/count_tokens", json={"model": MODEL, **body}, headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    def rendered(turns: list[dict[str, str]], prefill: bool = False) -> int:
        text = tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
        )
        return len(tokenizer.encode(text, add_special_tokens=False))

    turns = [*HELLO, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    assert count(messages=turns) == rendered(turns)
    assert count(messages=HELLO, system="Be brief.") == rendered([{"role": "system", "content": "Be brief."}, *HELLO])
    # A final assistant turn is continued (Anthropic's prefill); an empty one asks for a fresh answer.
    assert count(messages=[*HELLO, {"role": "assistant", "content": "The"}]) == rendered(
        [*HELLO, {"role": "assistant", "content": "The"}], prefill=True
    )
    assert count(messages=[*HELLO, {"role": "assistant", "content": ""}]) == rendered(HELLO)


def test_a_message_from_a_sampled_answer_and_its_stream(client, tokenizer, monkeypatch):
    """The whole route with the submission and its result stood in for (they need Temporal and a worker; the e2e
    test has both): what the engine returned becomes a Message, and the same as a stream."""
    answer = tokenizer.encode(" ello-hay") + [tokenizer.eos_token_id]
    seen: dict[str, Any] = {}

    async def submit(svc, samplers, who, target, prompt, knobs, max_tokens):
        seen.update(prompt=prompt, knobs=knobs, max_tokens=max_tokens, model_path=target.model_path)
        return "ref"

    async def results(svc, ref):
        return SimpleNamespace(sequences=[SimpleNamespace(tokens=answer, logprobs=None, stop_reason="stop")])

    monkeypatch.setattr(routes_anthropic, "submit", submit)
    monkeypatch.setattr(routes_anthropic, "results", results)
    body = _body(max_tokens=8, temperature=0, stop_sequences=["zzz"])
    out = client.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert out.status_code == 200, out.text
    msg = anthropic.types.Message.model_validate(out.json())
    assert msg.id.startswith("msg_") and msg.model == MODEL and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text == " ello-hay"
    usage = (msg.usage.output_tokens, msg.usage.input_tokens)
    assert msg.stop_reason == "end_turn" and usage == (len(answer), len(seen["prompt"]))
    assert seen["knobs"].stop == ["zzz"] and seen["max_tokens"] == 8 and seen["model_path"] == ""

    streamed = client.post("/v1/messages", json={**body, "stream": True}, headers=AUTH)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [_sse(part + "\n\n") for part in streamed.text.strip("\n").split("\n\n")]
    assert events[0][0] == "message_start" and events[0][1]["message"]["usage"]["input_tokens"] == len(seen["prompt"])
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == " ello-hay" and events[-2][1]["delta"]["stop_reason"] == "end_turn"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
_fields = st.sampled_from(
    [
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "metadata",
        "tools",
        "thinking",
        "cache_control",
    ]
)
_hostile_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", ""]), "content": _json}), max_size=3
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(_fields, _json, max_size=6), messages=_hostile_messages, count=st.booleans())
def test_hostile_bodies_get_a_4xx_in_anthropic_shape(client, body, messages, count):
    # Half the bodies carry a served model and message-shaped turns, so they get past the model lookup and reach
    # the content checks and the chat template.
    if messages:
        body = {**body, "model": MODEL, "messages": messages}
    if not count:
        # A valid /v1/messages body would go on to Temporal, which this app has none of (the e2e test has it).
        try:
            assume(MessagesRequest.model_validate(body).model != MODEL)
        except ValidationError:
            pass
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    response = client.post(path, json=body, headers=AUTH)
    if response.status_code == 200:  # a valid count_tokens body (a valid /v1/messages one would need Temporal)
        assert count and isinstance(response.json()["input_tokens"], int), (body, response.text)
        return
    assert 400 <= response.status_code < 500, (body, response.text)
    _error(response, response.status_code)
