"""The tiny Qwen3.5 and a tiny Qwen3 of the same width and depth, for benchmarks that set the two side by side.

The tiny Qwen3 as written for the tests is wider and shallower (hidden 128, 2 layers) than the tiny Qwen3.5 (hidden 96,
4 layers), so a family mix-up cannot pass a test; a comparison of their costs wants the same shape. The Qwen3 here is
the tiny Qwen3's writer with Qwen3.5's hidden size, depth, heads and MLP width: what is left to differ is the token
mixer (three of four layers Gated DeltaNet in Qwen3.5, all full attention in Qwen3). Both allow `positions` tokens.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

FAMILIES = ("qwen3", "qwen3_5")


def qwen3_5_shape() -> dict[str, int]:
    """The tiny Qwen3.5's width and depth, as the keys the tiny Qwen3's config shares with it."""
    from tinkerflow.workers.engine.model.families.qwen3_5.tiny import QWEN35_SHAPE

    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {k: QWEN35_SHAPE[k] for k in (*keys, "intermediate_size")}


def tiny_model(family: str, directory: Path, positions: int) -> Path:
    """`family`'s tiny checkpoint in `directory`, allowing `positions` tokens; the Qwen3 at the tiny Qwen3.5's shape."""
    from tinkerflow.workers.engine.model import tiny_model as writer

    # The writer reads its shape table when it writes (config.json, tensor shapes, the tokenizer's max length) and
    # records it in the directory's marker, so a patched table gives a distinct, complete checkpoint.
    shape = {"max_position_embeddings": positions, **(qwen3_5_shape() if family == "qwen3" else {})}
    with mock.patch.dict(writer.SHAPE, shape):
        return writer.make_tiny_model(directory / family, family=family, progress=False)
