"""The tiny Qwen3.5 and Qwen3.5-MoE checkpoints (`make_tiny_model(..., family="qwen3_5")`): transformers loads them
offline with no missing or unexpected keys, the engine's loader gives transformers' logits (at the qwen3_5 parity
tests' whole-model tolerance), and tinker-cookbook's `qwen3_5` renderer builds prompts and parses responses on its
tokenizer."""

from __future__ import annotations

import json
import os
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qwen3_5_reference import logits_close, positions, routing

from tinkerflow.workers.engine.model.families import family_name_of
from tinkerflow.workers.engine.model.families.qwen3 import tiny as qwen3_tiny
from tinkerflow.workers.engine.model.families.qwen3_5.tiny import CHAT_TOKENS
from tinkerflow.workers.engine.model.loader import load_model
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, family=request.param), request.param


def test_transformers_loads_it_whole_and_the_engine_gives_its_logits(model_dir):
    directory, family = model_dir
    hf = json.loads((directory / "config.json").read_text())
    assert family_name_of(hf) == family
    assert hf["hidden_size"] != qwen3_tiny.config_dict(0)["hidden_size"]  # not the tiny Qwen3's shape
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True, experts_implementation="eager"
    )
    assert type(model).__name__ == ("Qwen3_5MoeForCausalLM" if family == "qwen3_5_moe" else "Qwen3_5ForCausalLM")
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    tokens = np.random.default_rng(0).integers(0, hf["vocab_size"], (2, 19))
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(tokens)).logits.numpy()
    assert float(want.std(axis=-1).mean()) > 1.0  # logits that are not flat
    loaded = load_model(str(directory), max_adapters=2, max_rank=4, progress=False)
    ours = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
    logits_close(np.asarray(ours(jnp.asarray(tokens, jnp.int32), positions(19, 2), routing(2))), want, family)


def test_cookbook_qwen3_5_renderer_renders_and_round_trips(model_dir):
    from tinker_cookbook.renderers import get_renderer

    directory, _ = model_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    for token in ("<|im_start|>", "<|im_end|>", *CHAT_TOKENS):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    renderer = get_renderer("qwen3_5", tokenizer)
    messages: list[Any] = [{"role": "user", "content": "What is a banana split?"}]
    prompt = renderer.build_generation_prompt(messages)
    text = tokenizer.decode(prompt.to_ints())
    assert text == "<|im_start|>user\nWhat is a banana split?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # A sampled reply (after the prefilled <think>\n) parses back into its thinking and its answer.
    reply = tokenizer.encode("Ice cream.\n</think>\n\nA dessert.<|im_end|>", add_special_tokens=False)
    message, _ = renderer.parse_response(reply)
    parts: dict[str, Any] = {p["type"]: p for p in message["content"]}  # type: ignore[index]
    assert parts["thinking"]["thinking"].strip() == "Ice cream."
    assert parts["text"]["text"].strip() == "A dessert."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text  # round-trips
