"""Images on the wire through the unmodified SDK against the real stack serving the tiny Qwen3.5 vision-language
model (`make-tiny-model --family qwen3_5 --vision`): a datum with an image trains (its loss falls over 5 steps, and
`forward` scores it); an `expected_tokens` that disagrees, a truncated png, a 40-megapixel image and a text file
named .png each fail their own future as a `user` error naming the field or the limit, while another tenant's
forward_backward loop runs through them; the JAX worker's process is the same throughout. A sample's bad image fails
the same way; an `image_asset_pointer` chunk is refused by name; chat completions refuse a remote image URL by name,
and the Messages API a `url` source. A prompt with an image samples, and its `compute_logprobs` equals the training
forward's logprobs of the same model_input; the `openai` and `anthropic` clients' chats with an image answer what the
SDK samples from the same prompt, built as transformers' processor builds it. One stack, a few steps."""

from __future__ import annotations

import base64
import io
import json
import threading
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from PIL import Image
from tinker import types

from tests.e2e.conftest import API_KEY, OTHER_API_KEY
from tinkerflow.cli.launch import launch
from tinkerflow.common.images import MAX_IMAGE_PIXELS
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e
TIMEOUT_S = 600
TOKENS = [5, 17, 42, 99, 3, 250, 7, 11, 64, 2, 9, 1500, 33]


def _png(height: int = 100, width: int = 150) -> bytes:
    """Noise, so cutting the file cuts the pixel data (100 x 150 becomes 15 tokens on the tiny model)."""
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _big_png() -> bytes:
    """8,000 x 5,000 pixels of one colour: 40 megapixels in a small file."""
    out = io.BytesIO()
    Image.new("RGB", (8000, 5000), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _tensor(values: list, dtype: Any = np.float32) -> types.TensorData:
    return types.TensorData.from_numpy(np.asarray(values, dtype))


def _datum(*image: types.ImageChunk) -> types.Datum:
    chunks: list[Any] = [types.EncodedTextChunk(tokens=TOKENS[:4]), *image, types.EncodedTextChunk(tokens=TOKENS[4:8])]
    n = 8 + sum(c.expected_tokens or 0 for c in image)
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": _tensor([1] * n, np.int64), "weights": _tensor([1.0] * n)},
    )


def _text_datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": _tensor(TOKENS[1:], np.int64), "weights": _tensor([1.0] * (len(TOKENS) - 1))},
    )


def _user_error(future) -> str:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=TIMEOUT_S)
    assert str(info.value.category).lower().endswith("user"), info.value
    return str(info.value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("e2e-images") / "tiny-qwen3_5-vl", family="qwen3_5", vision=True)
    return model


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-images-state")
    s = launch(root / "state", api_key=API_KEY, extra=["--base-model", str(model_dir), "--api-key", OTHER_API_KEY])
    yield s
    s.stop()


def test_bad_images_are_user_errors_while_another_tenant_trains(stack):
    model = stack.served_model()
    pid = stack.parts()["jax-worker"]["pid"]
    theirs = (
        tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER_API_KEY)
        .create_lora_training_client(base_model=model, rank=8)
        .result()
    )
    losses: list[float] = []
    failures: list[BaseException] = []
    running, checked = threading.Event(), threading.Event()

    def their_loop() -> None:
        try:
            while not checked.is_set() or len(losses) < 4:
                out = theirs.forward_backward([_text_datum()], "cross_entropy").result(timeout=TIMEOUT_S)
                losses.append(out.metrics["loss:sum"])
                theirs.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)
                running.set()
        except BaseException as e:  # reported by the main thread
            failures.append(e)
            running.set()

    loop = threading.Thread(target=their_loop, name="other-tenant")
    loop.start()
    try:
        assert running.wait(TIMEOUT_S)
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
        mine = service.create_lora_training_client(base_model=model, rank=8).result()
        png = _png()
        where = "forward_backward: datum 0: model_input.chunks[1]: "

        def fb(image: types.ImageChunk) -> str:
            return _user_error(mine.forward_backward([_datum(image)], "cross_entropy"))

        err = fb(types.ImageChunk(data=png, format="png", expected_tokens=7))
        assert where + "expected_tokens=7 but the image becomes 15 tokens" in err
        err = fb(types.ImageChunk(data=png[: len(png) // 2], format="png", expected_tokens=15))
        assert where + "image data is not a valid png image" in err
        err = fb(types.ImageChunk(data=_big_png(), format="png", expected_tokens=64))
        assert where + f"image is 8000x5000 pixels, over the limit of {MAX_IMAGE_PIXELS} pixels" in err
        err = fb(types.ImageChunk(data=b"notes.txt, renamed notes.png\n" * 20, format="png", expected_tokens=15))
        assert where + "image data is not a valid png image" in err
        # Every refusal consumed its place in the sequence: the same client trains right after.
        out = mine.forward_backward([_text_datum()], "cross_entropy").result(timeout=TIMEOUT_S)
        assert np.isfinite(out.metrics["loss:sum"])

        sampler = service.create_sampling_client(base_model=model).result()
        prompt = types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=TOKENS[:4]),
                types.ImageChunk(data=png, format="png", expected_tokens=9),
            ]
        )
        err = _user_error(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)))
        assert "sample: prompt: chunks[1]: expected_tokens=9 but the image becomes 15 tokens" in err
        cut = types.ModelInput(
            chunks=[*prompt.chunks[:1], types.ImageChunk(data=png[: len(png) // 2], format="png", expected_tokens=15)]
        )
        err = _user_error(sampler.sample(cut, 1, types.SamplingParams(max_tokens=2)))
        assert "sample: prompt: chunks[1]: image data is not a valid png image" in err
        err = _user_error(sampler.compute_logprobs(cut))
        assert "sample: prompt: chunks[1]: image data is not a valid png image" in err
        pointer = types.ModelInput(
            chunks=[types.ImageAssetPointerChunk(format="png", location="s3://bucket/cat.png", expected_tokens=15)]
        )
        err = _user_error(sampler.sample(pointer, 1, types.SamplingParams(max_tokens=2)))
        assert "image_asset_pointer chunks are not served" in err
    finally:
        checked.set()
        loop.join(TIMEOUT_S)
    assert not failures, failures
    assert len(losses) >= 4 and all(np.isfinite(losses)), losses
    assert stack.parts()["jax-worker"]["pid"] == pid


def test_chat_completions_refuse_a_remote_image_url_by_name(stack):
    def chat(url: str) -> dict:
        content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        response = httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            json={"model": stack.served_model(), "messages": [{"role": "user", "content": content}]},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert "this service does not fetch images" in chat("https://example.com/cat.png")["message"]
    truncated = "data:image/png;base64," + base64.b64encode(_png()[:300]).decode()
    assert "image data is not a valid png image" in chat(truncated)["message"]


def test_a_datum_with_an_image_trains(stack):
    """The image's 15 placeholder positions sit between text; the weighted targets are the text after it, so the
    loss reads the tower's features through attention. Five AdamW steps lower it; `forward` answers one logprob per
    position, the image's included; the console's run page and chart show the run as any other."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
    client = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
    image = types.ImageChunk(data=_png(), format="png", expected_tokens=15)
    before, after = TOKENS[:4], TOKENS[4:]
    chunks: list[Any] = [types.EncodedTextChunk(tokens=before), image, types.EncodedTextChunk(tokens=after[:-1])]
    n = len(before) + 15 + len(after) - 1
    targets = [0] * (len(before) + 15 - 1) + after
    weights = [0.0] * (len(before) + 15 - 1) + [1.0] * len(after)
    datum = types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": _tensor(targets, np.int64), "weights": _tensor(weights)},
    )
    assert datum.model_input.length == n == len(targets)
    losses = []
    for _ in range(5):
        out = client.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
        losses.append(out.metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] * 0.8, losses
    scored = client.forward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
    assert len(scored.loss_fn_outputs[0]["logprobs"].tolist()) == n
    assert scored.metrics["loss:sum"] < losses[0]
    # The console shows the run like any other: its page's facts, and its chart's points carry the five losses.
    headers = {"X-API-Key": API_KEY}
    run = httpx.get(f"{stack.base_url}/api/v1/console/runs/{client.model_id}", headers=headers, timeout=60).json()
    assert run["step"] == 5 and run["base_model"] == stack.served_model(), run
    points = httpx.get(f"{stack.base_url}{run['metrics_url']}", headers=headers, timeout=60).json()["points"]
    plotted = [p["metrics"]["loss:sum"] for p in points if p["op"] == "forward_backward"]
    np.testing.assert_allclose(plotted, losses, rtol=1e-6)


# The sampler's prefill (prompt chunks, the tower run alone) and one training forward differ only in float32 rounding
# on the tiny model (tests/engine/test_qwen3_5_vision_sampling.py holds the engine to 1e-5); a misplaced image,
# a wrong rotary position or a missing feature moves a logprob by far more.
LOGPROB_ATOL = 1e-4


def test_a_prompt_with_an_image_samples_and_scores_as_the_forward_does(stack, model_dir):
    """A trained adapter's sampling client samples from a prompt with an image, and `compute_logprobs` of that
    prompt equals the training client's `forward` logprobs of the same model_input, placeholders included."""
    image_id = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
    client = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
    image = types.ImageChunk(data=_png(), format="png", expected_tokens=15)
    before, after = TOKENS[:4], TOKENS[4:8]
    prompt = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=before), image, types.EncodedTextChunk(tokens=after)]
    )
    ids = [*before, *[image_id] * 15, *after]
    assert prompt.length == len(ids)
    datum = types.Datum(
        model_input=prompt,
        loss_fn_inputs={"target_tokens": _tensor([*ids[1:], 0], np.int64), "weights": _tensor([1.0] * len(ids))},
    )
    client.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)  # the adapter is not zero
    sampler = client.save_weights_and_get_sampling_client().result()

    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=3)).result(timeout=TIMEOUT_S)
    assert len(out.sequences) == 2 and all(len(s.tokens) >= 1 for s in out.sequences), out

    scored = sampler.compute_logprobs(prompt).result(timeout=TIMEOUT_S)
    assert len(scored) == len(ids) and scored[0] is None
    got = np.asarray(scored[1:], np.float64)
    assert np.all(np.isfinite(got)), got
    forward = client.forward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
    want = np.asarray(forward.loss_fn_outputs[0]["logprobs"].tolist()[:-1], np.float64)
    np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)


def _processor_prompt(model_dir, content: list[dict]) -> tuple[list[int], list[int]]:
    """The chat's text tokens around its one image, as transformers' processor builds the prompt: the chat template's
    rendering cut at `<|image_pad|>`, which the processor widens to the image's 15 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    before, after = text.split("<|image_pad|>")
    return tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)


def test_openai_and_anthropic_chats_with_an_image_answer_as_the_sdk_samples(stack, model_dir):
    """Greedy, so each endpoint's answer is the SDK sampler's from the prompt the processor would build: the same
    logprobs, and a prompt of the text's tokens plus the image's 15."""
    import anthropic
    import openai

    png = _png()
    before, after = _processor_prompt(model_dir, [{"type": "text", "text": "what is this?"}, {"type": "image"}])
    prompt = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=before),
            types.ImageChunk(data=png, format="png", expected_tokens=15),
            types.EncodedTextChunk(tokens=after),
        ]
    )
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
    sampler = service.create_sampling_client(base_model=stack.served_model()).result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    want = sampler.sample(prompt, 1, greedy).result(timeout=TIMEOUT_S).sequences[0]

    oai = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, timeout=TIMEOUT_S)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content: Any = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    chat = oai.chat.completions.create(
        model=stack.served_model(),
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == prompt.length == len(before) + 15 + len(after)
    assert chat.usage.completion_tokens == len(want.tokens)
    got = [t.logprob for t in (chat.choices[0].logprobs.content or [])]  # pyright: ignore[reportOptionalMemberAccess]
    np.testing.assert_allclose(got, np.asarray(want.logprobs, np.float64), atol=LOGPROB_ATOL, rtol=0)

    claude = anthropic.Anthropic(base_url=stack.base_url, api_key=API_KEY, timeout=TIMEOUT_S, max_retries=0)
    source: Any = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    blocks = [{"type": "text", "text": "what is this?"}, {"type": "image", "source": source}]
    # This SDK has no temperature argument; the API takes one.
    args: dict[str, Any] = {"model": stack.served_model(), "max_tokens": 4, "extra_body": {"temperature": 0.0}}
    message = claude.messages.create(**args, messages=[{"role": "user", "content": blocks}])
    assert message.usage.input_tokens == prompt.length
    assert message.usage.output_tokens == len(want.tokens)
    assert message.content[0].text == chat.choices[0].message.content  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(anthropic.BadRequestError, match="this service does not fetch images"):
        remote: Any = [{"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]
        claude.messages.create(**args, messages=[{"role": "user", "content": remote}])
