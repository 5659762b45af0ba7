"""Tiny checkpoints in the Hugging Face layout (config by transformers' own config classes), plus a BPE tokenizer
trained on a few sentences.

Weights are drawn with std 0.25 (norm weights near one): with HF's default std 0.02 the logits are nearly flat, and
parity, sampling and training tests could not fail.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "hello world, this is a tiny tokenizer for tests",
    "tinker trains low rank adapters on a shared base model",
    "stop here. then go on; numbers 0 1 2 3 4 5 6 7 8 9",
] * 4

MAX_ADAPTERS = 4
MAX_RANK = 8


def build_tokenizer(directory: Path) -> int:
    """Train a byte-level BPE on CORPUS, save it as a fast tokenizer in `directory`; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return len(fast)


def build_model(directory: Path, *, arch: str = "qwen3", tie: bool = False, seed: int = 0) -> Path:
    """Write config.json (via transformers' config class) and model.safetensors with numpy; no torch needed."""
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, Qwen3Config

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(directory)
    h, inter, heads, kv, hd, layers = 64, 128, 4, 2, 16, 2
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        intermediate_size=inter,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        eos_token_id=0,
    )
    if arch == "qwen3":
        config = Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(**common, rope_parameters=rope, architectures=["LlamaForCausalLM"])
    config.save_pretrained(directory)

    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(0.0, 0.25, size=shape).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": np.ones(h, np.float32)}
    if not tie:
        tensors["lm_head.weight"] = normal(vocab, h)
    for i in range(layers):
        pre = f"model.layers.{i}."
        tensors.update(
            {
                pre + "self_attn.q_proj.weight": normal(heads * hd, h),
                pre + "self_attn.k_proj.weight": normal(kv * hd, h),
                pre + "self_attn.v_proj.weight": normal(kv * hd, h),
                pre + "self_attn.o_proj.weight": normal(h, heads * hd),
                pre + "mlp.gate_proj.weight": normal(inter, h),
                pre + "mlp.up_proj.weight": normal(inter, h),
                pre + "mlp.down_proj.weight": normal(h, inter),
                pre + "input_layernorm.weight": 1.0 + normal(h) * 0.4,
                pre + "post_attention_layernorm.weight": 1.0 + normal(h) * 0.4,
            }
        )
        if arch == "qwen3":
            tensors[pre + "self_attn.q_norm.weight"] = 1.0 + normal(hd) * 0.4
            tensors[pre + "self_attn.k_norm.weight"] = 1.0 + normal(hd) * 0.4
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="session")
def make_checkpoint():
    """build_model, for tests that need a checkpoint of their own (another arch, tied embeddings)."""
    return build_model


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def engine(qwen3_dir):
    """One engine for the session (compiles are per engine); tests re-create the slots they use."""
    from tinkerflow.workers.engine.engine import Engine

    logging.getLogger("tinkerflow").setLevel(logging.INFO)
    return Engine.load(str(qwen3_dir), max_lora_adapters=MAX_ADAPTERS, max_lora_rank=MAX_RANK, progress=False)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
