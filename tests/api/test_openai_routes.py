"""The OpenAI-compatible routes against hostile input, without a stack: every answer is OpenAI's error shape with a
4xx status (never a 5xx or a traceback), up to the point where a request would reach Temporal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinkerflow.api import routes_openai
from tinkerflow.common.checkpoints import CheckpointNotFound
from tinkerflow.common.settings import Settings

KEY = "tml-unit"


class _NoModels:
    async def get(self, name: str):
        return None

    async def cards(self, fresh: bool = False):
        return {}


class _NoCheckpoints:
    def readable(self, path: str, who: str):
        raise CheckpointNotFound(f"checkpoint {path} does not exist")


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    app = FastAPI()
    app.include_router(routes_openai.router)
    app.state.services = SimpleNamespace(
        api_keys=(KEY,),
        owner_of=lambda key: "owner",
        registry=_NoModels(),
        checkpoints=_NoCheckpoints(),
        settings=Settings(state_dir=tmp_path_factory.mktemp("state")),
    )
    return TestClient(app, raise_server_exceptions=False)


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_auth_unknown_models_and_bad_bodies_answer_in_openai_shape(client):
    assert _error(client.get("/v1/models"), 401)["type"] == "authentication_error"
    assert _error(client.get("/v1/models", headers={"Authorization": "Bearer tml-other"}), 401)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/models", headers=auth).json() == {"object": "list", "data": []}
    body = {"model": "nope", "prompt": "hi"}
    assert _error(client.post("/v1/completions", json=body, headers=auth), 404)["code"] == "model_not_found"
    private = {"model": "tinker://sess-x:train:0/sampler_weights/a", "messages": [{"role": "user", "content": "x"}]}
    assert _error(client.post("/v1/chat/completions", json=private, headers=auth), 404)["param"] == "model"
    assert _error(client.post("/v1/completions", content=b"{not json", headers=auth), 400)
    assert _error(client.post("/v1/completions", json=[1, 2], headers=auth), 400)
    assert _error(client.post("/v1/completions", json={"prompt": "x"}, headers=auth), 400)["param"] == "model"
    too_many = {"model": "m", "prompt": "x", "n": 10**6}
    assert _error(client.post("/v1/completions", json=too_many, headers=auth), 400)["param"] == "n"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
_fields = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "echo",
        "stream",
        "stream_options",
        "logit_bias",
        "tools",
        "response_format",
        "best_of",
    ]
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(_fields, _json, max_size=6), chat=st.booleans())
def test_hostile_bodies_get_a_4xx_in_openai_shape(client, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert 400 <= response.status_code < 500, (body, response.text)
    _error(response, response.status_code)


def test_a_stream_sends_keepalive_comments_while_the_engine_works_then_chunks_and_done(monkeypatch):
    import asyncio

    from tinkerflow.api import openai_stream
    from tinkerflow.api.openai_render import Rendered

    monkeypatch.setattr(openai_stream, "KEEPALIVE_S", 0.05)

    async def slow() -> list[Rendered]:
        await asyncio.sleep(0.3)
        return [Rendered("ab", ["a", "b"], [-1.0, -2.0], "length", 2)]

    async def collect() -> list[str]:
        req = SimpleNamespace(logprobs=None, stream_options=None)
        response = openai_stream.stream({"id": "x", "object": "text_completion"}, slow(), 3, req, chat=False)
        return [cast(str, part) async for part in response.body_iterator]  # the stream's events are str

    parts = asyncio.run(collect())
    assert parts[0].startswith(": ") and parts[-1] == "data: [DONE]\n\n"
    data = [p for p in parts if p.startswith("data: {")]
    assert len(data) == 3 and '"text":"a"' in data[0] and '"finish_reason":"length"' in data[-1]
