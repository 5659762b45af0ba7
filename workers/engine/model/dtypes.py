"""The base weights' dtype: float32 on CPU, bfloat16 on accelerators, and what a checkpoint may be loaded as."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def default_dtype() -> Any:
    """float32 on CPU (faster there than bf16, and exact parity); bfloat16 weights on GPU/TPU."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(jnp.bfloat16)


def weight_dtype(dtype: Any) -> Any:
    """The base weights' dtype for a requested one (None: the default); ValueError for one the engine cannot run."""
    if dtype is None:
        return default_dtype()
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"dtype {dtype} is not supported for base weights (float32, bfloat16 or float16)")
    return dtype


def base_dtype(base: Any) -> Any:
    """The dtype of the base matrices, read off the embedding (norms are always float32)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]:
        if any(getattr(k, "key", getattr(k, "name", None)) == "embed_tokens" for k in path):
            return leaf.dtype
    raise ValueError("base state has no embed_tokens")
