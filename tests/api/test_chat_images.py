"""A chat's images in its prompt (platform/api/chat_images.py): the chat template places each image's vision tokens,
and the rendered text is cut at each image token into text chunks around one ImageChunk per image, whose
placeholders the worker widens to the image's token count. Checked against what transformers' Qwen2-VL processor
does with the same rendered text (each `<|image_pad|>` repeated as many times as its image makes tokens, then
tokenized): the token ids agree one for one."""

from __future__ import annotations

import base64
import json
import re

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerFast

from tinkerflow.api.anthropic_wire import PromptRequest
from tinkerflow.api.chat_images import ChatPrompt, chat_prompt
from tinkerflow.api.image_checks import RawImage
from tinkerflow.api.openai_models import ChatMessage, OpenAIError
from tinkerflow.workers.engine.model.tiny_tokenizer import EOS_TOKEN, build_tokenizer
from tinkerflow.workflows.protocol.messages import ModelCard

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
# Qwen3.5's chat template's way with content items, in brief: an image item is its three vision tokens.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(extra_tokens=VISION_TOKENS),
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def card(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("vl")
    (root / "config.json").write_text(json.dumps({"image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>")}))
    return ModelCard("tiny-vl", "qwen3_5", str(root), 2048, 2048, image_processor={})


PNG = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"\x89PNG").decode()}


def _image(i: int) -> RawImage:
    return RawImage(f"prompt: messages[0].content[{i}].image_url", b"png bytes %d" % i, "png", None)


def test_each_image_sits_where_the_template_put_its_image_token(tokenizer, card):
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": "data:..."}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": "data:..."}},
    ]
    messages = [ChatMessage(role="user", content=content).as_template_input()]
    assert messages[0]["content"][1] == {"type": "image"}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = chat_prompt(tokenizer, text, [_image(1), _image(3)], [15, 4], card)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # What a processor builds: the rendered text with each <|image_pad|> widened to the image's tokens.
    want = tokenizer.encode(
        text.replace("<|image_pad|>", "\0", 1)
        .replace("<|image_pad|>", "<|image_pad|>" * 4)
        .replace("\0", "<|image_pad|>" * 15),
        add_special_tokens=False,
    )
    got: list[int] = []
    for chunk in prompt.chunks:
        if chunk["type"] == "image":
            got += [pad] * chunk["expected_tokens"]
            assert base64.b64decode(chunk["data"]).startswith(b"png bytes") and chunk["format"] == "png"
        else:
            got += chunk["tokens"]
    assert got == want and len(prompt) == len(want)
    vision_start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert [c["type"] for c in prompt.chunks] == ["encoded_text", "image", "encoded_text", "image", "encoded_text"]
    assert prompt.chunks[0]["tokens"][-1] == vision_start


def test_text_only_chats_are_one_text_chunk(tokenizer, card):
    assert ChatMessage(role="user", content=[{"type": "text", "text": "hi"}]).as_template_input()["content"] == "hi"
    prompt = chat_prompt(tokenizer, "hello there", [], [], card)
    assert prompt == ChatPrompt.of_tokens(tokenizer.encode("hello there", add_special_tokens=False))


def test_a_template_that_places_no_image_token_is_a_400(tokenizer, card):
    with pytest.raises(OpenAIError) as e:
        chat_prompt(tokenizer, "<|im_start|>user\nno image here<|im_end|>\n", [_image(1)], [15], card)
    assert (e.value.status, e.value.code) == (400, "invalid_image")
    assert "placed 0 image tokens for the 1 images" in e.value.message


def test_anthropic_image_blocks_become_image_items_in_order():
    source = {**PNG, "media_type": "image/jpeg"}
    req = PromptRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "?"}]}
            ],
        }
    )
    assert req.turns() == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    [image] = req.images()
    assert (image.where, image.data, image.format) == ("prompt: messages.0.content.0", b"\x89PNG", "jpeg")


@pytest.mark.parametrize(
    "body, says",
    [
        ({"system": [{"type": "image", "source": {"type": "base64"}}]}, "content blocks of type 'image' are not"),
        ({"content": [{"type": "image", "source": {}}]}, "an image block with no source"),
        ({"content": [{"type": "image", "source": {**PNG, "media_type": "image/gif"}}]}, "media_type 'image/gif'"),
        ({"content": [{"type": "image", "source": {**PNG, "data": "***"}}]}, "data is not valid base64"),
        ({"content": [{"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}]}, "does not fetch"),
    ],
)
def test_anthropic_image_blocks_the_service_cannot_take_are_named(body, says):
    content = body.pop("content", "hi")
    with pytest.raises(ValidationError, match=re.escape(says)):
        PromptRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": content}], **body})
