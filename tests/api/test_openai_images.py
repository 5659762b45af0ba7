"""Chat completions' `image_url` parts through the route, without a stack: a data: URL goes through the same image
checks as an ImageChunk, a remote URL is refused by name (the service does not fetch), and every answer is a 400 in
OpenAI's error shape naming the part, before anything reaches Temporal."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from tinkerflow.api import routes_openai
from tinkerflow.common.images import MAX_IMAGE_PIXELS
from tinkerflow.common.settings import Settings
from tinkerflow.workflows.protocol.messages import ModelCard

KEY = "tml-unit"
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 4096, "longest_edge": 65536}}
CARDS = {
    "tiny-vl": ModelCard("tiny-vl", "qwen3_5", "", 2048, 2048, image_processor=PROCESSOR),
    "tiny": ModelCard("tiny", "qwen3", "", 2048, 2048),
}


class _Models:
    async def get(self, name: str):
        return CARDS.get(name)


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    app = FastAPI()
    app.include_router(routes_openai.router)
    app.state.services = SimpleNamespace(
        api_keys=(KEY,),
        owner_of=lambda key: "owner",
        registry=_Models(),
        settings=Settings(state_dir=tmp_path_factory.mktemp("state")),
    )
    return TestClient(app, raise_server_exceptions=False)


def _png(height: int = 100, width: int = 150) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _chat(client: TestClient, url: str, model: str = "tiny-vl") -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    content = [{"type": "text", "text": "what is this?"}, part]
    response = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}]},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_remote_url_is_refused_by_name(client):
    error = _chat(client, "https://example.com/cat.png")
    assert error["message"] == (
        "messages[0].content[1].image_url.url is a remote https URL: this service does not fetch images; send the "
        "image inline as a data: URL (data:image/png;base64,... or data:image/jpeg;base64,...)"
    )
    assert (error["param"], error["code"]) == ("messages[0].content[1].image_url", "invalid_image_url")


@pytest.mark.parametrize(
    "url, needle",
    [
        ("ftp://example.com/cat.png", "is not a data: URL"),
        ("data:image/png,rawbytes", "must be a base64 data: URL"),
        ("data:image/gif;base64,R0lGOD", "has media type 'image/gif'"),
        ("data:image/png;base64,***", "is not valid base64"),
    ],
)
def test_other_urls_are_refused_by_name(client, url, needle):
    assert needle in _chat(client, url)["message"]


def test_data_url_images_go_through_the_image_checks(client):
    truncated = _png()[: len(_png()) // 2]
    error = _chat(client, _data_url(truncated))
    assert error["message"].startswith(
        "prompt: messages[0].content[1].image_url: image data is not a valid png image"
    ), error
    big = io.BytesIO()
    Image.new("RGB", (8000, 5000)).save(big, format="PNG")
    assert f"over the limit of {MAX_IMAGE_PIXELS} pixels" in _chat(client, _data_url(big.getvalue()))["message"]
    assert "not a valid png image" in _chat(client, _data_url(b"hello, I am a text file"))["message"]
    assert "not a valid jpeg image" in _chat(client, _data_url(_png(), "image/jpeg"))["message"]


def test_a_text_model_refuses_images_by_name(client):
    assert _chat(client, _data_url(_png()), model="tiny")["message"] == (
        "base model 'tiny' has no vision tower: it takes text chunks only, not images"
    )
