"""Log-probabilities over the vocabulary in chunks of tokens, so the [tokens, vocab] logits never exist whole.

A real Qwen3 has 151,936 vocabulary entries: at 40,960 tokens its float32 logits are 25 GB, more than the rest of a
step. The unembedding, log-softmax and the gather of the wanted entries run one chunk of positions at a time
(`jax.lax.map` over chunks, each under `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of
keeping them): the live logits are [rows, chunk, vocab] whatever the length. The chunk is sized by bytes
(`LOGITS_CHUNK_BYTES`); a model whose whole logits fit in one chunk (the tiny test models) runs unchunked, the same
program as before.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# float32 logits alive at a time per chunk (and as much again for their gradient in the backward pass).
LOGITS_CHUNK_BYTES = 256 * 2**20


def chunk_tokens(rows: int, vocab: int, budget_bytes: int | None = None) -> int:
    """Positions per chunk: a power of two whose [rows, chunk, vocab] float32 logits fit `budget_bytes` (default
    LOGITS_CHUNK_BYTES), at least 16."""
    fit = max(16, (budget_bytes or LOGITS_CHUNK_BYTES) // max(1, rows * vocab * 4))
    return 1 << (fit.bit_length() - 1)


def _chunked(fn, h: jax.Array, extra: jax.Array, chunk: int) -> jax.Array:
    """fn(h [B, c, H], extra [B, c, ...]) -> [B, c, ...] applied chunk by chunk over the position axis."""
    b, t = h.shape[:2]
    if chunk >= t:
        return fn(h, extra)
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), (split(h), split(extra)))
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(b, n * chunk, *out.shape[3:])[:, :t]


def target_logprobs(model: Any, h: jax.Array, targets: jax.Array, routing: Any, chunk: int) -> jax.Array:
    """log p(targets) float32 [B, T, K] from final hidden states h [B, T, H] and target ids [B, T, K]."""

    def one(hx, tx):
        logits = model.logits(hx, routing)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        return jnp.take_along_axis(logits, tx, axis=-1) - lse

    return _chunked(one, h, targets, chunk)


def scored_next(model: Any, h: jax.Array, nexts: jax.Array, routing: Any, k: int, chunk: int):
    """Prompt scoring for the sampler: at every position of h [R, T, H], the log-prob of the token that follows it
    (`nexts` [R, T]; a negative id scores token 0, for the caller to ignore) [R, T] and the k most likely next tokens
    (ids int32, log-probs) [R, T, k], chunk by chunk."""

    def one(hx, nx):
        logp = jax.nn.log_softmax(model.logits(hx, routing), axis=-1)
        token_lp = jnp.take_along_axis(logp, jnp.maximum(nx, 0)[..., None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(logp, k)
        return jnp.concatenate([token_lp[..., None], top_lp, top_ids.astype(jnp.float32)], axis=-1)

    # One array per position (the map's output): next-token log-prob, k log-probs, k ids (exact in float32 for any
    # vocabulary below 2**24).
    packed = _chunked(one, h, nexts, chunk)
    return packed[..., 0], packed[..., 1 + k :].astype(jnp.int32), packed[..., 1 : 1 + k]
