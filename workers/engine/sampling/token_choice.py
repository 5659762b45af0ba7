"""How a row's next token and its log-prob are chosen, on the device: the sampling maths of `decode.py`'s programs.

A row's randomness depends only on (seed, sample index, token index): one uniform per row and step, turned into a
token by inverse-CDF over the (temperature-scaled, top-k/top-p-filtered) distribution, so a seed reproduces its
samples whatever else is in the batch. top-k/top-p filtering (a full-vocab sort) runs only in steps where some row
uses it, and the top tokens a row keeps only where some row asks (`when`: one program either way).

Reported logprobs are log_softmax of the unmodified logits (temperature 1, no top-k/top-p), the quantity the
trainer computes, so sampler and trainer agree for the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Block size of the two-level inverse-CDF search.
_CDF_BLOCK = 64


@jax.tree_util.register_dataclass
@dataclass
class RowParams:
    """Per-row sampling settings."""

    temperature: jax.Array  # float32 [B]; 0 = greedy
    top_k: jax.Array  # int32 [B]; <= 0 = off
    top_p: jax.Array  # float32 [B]; 1 = off
    seed: jax.Array  # uint32 [B, 2] (low, high words)
    sample_index: jax.Array  # int32 [B]
    max_tokens: jax.Array  # int32 [B]
    stop_ids: jax.Array  # int32 [B, M]; -1 = unused
    topk: jax.Array  # int32 [B]: top tokens the row keeps per sampled position (0: none)


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside each row's top-k, then outside the smallest set whose probability reaches top_p."""
    vocab = scaled.shape[-1]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    ordered = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # the most likely token is always kept
    last_kept = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)
    threshold = jnp.take_along_axis(ordered, last_kept[:, None], axis=-1)
    return jnp.where(scaled < threshold, -jnp.inf, scaled)


def _uniforms(p: RowParams, step: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row from (seed, sample index, token index) alone."""

    def one(seed, index, t):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), index), t)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(p.seed, p.sample_index, step)


def _last_true(mask: jax.Array) -> jax.Array:
    return mask.shape[-1] - 1 - jnp.argmax(mask[..., ::-1], axis=-1)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Index i with P(i) = weights[i] / sum(weights) for u ~ U[0, 1), per row; O(vocab) with a two-level search
    (block sums, then a cumulative sum inside the chosen block). Never returns a zero-weight index."""
    b, vocab = weights.shape
    pad = (-vocab) % _CDF_BLOCK
    blocks = jnp.pad(weights, ((0, 0), (0, pad))).reshape(b, -1, _CDF_BLOCK)
    sums = jnp.sum(blocks, axis=-1)  # [B, NB]
    ends = jnp.cumsum(sums, axis=-1)
    target = u * ends[:, -1]
    blk = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), blocks.shape[1] - 1)
    inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
    start = jnp.take_along_axis(ends - sums, blk[:, None], axis=-1)
    positive = inner > 0
    hit = ((start + jnp.cumsum(inner, axis=-1)) > target[:, None]) & positive
    within = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), _last_true(positive))
    # Rounding can only land on a block without weight when the row's mass is all elsewhere: take its mode.
    return jnp.where(jnp.any(positive, axis=-1), blk * _CDF_BLOCK + within, jnp.argmax(weights, axis=-1))


def top_tokens(logits: jax.Array, k: int, asked: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens per row (ids int32 [B, k], log-probs [B, k]), computed only when `asked` (a traced
    bool: some row wants them), zeros otherwise."""

    def top(x):
        lp, ids = jax.lax.top_k(x, k)
        return ids.astype(jnp.int32), lp - jax.nn.logsumexp(x, axis=-1, keepdims=True)

    return when(asked, top, logits)


def when(flag: jax.Array, fn, *args):
    """fn(*args) where the traced `flag` holds, zeros of its shapes where not: one program, the work only when
    asked (how the sampler keeps optional outputs from being shapes)."""
    zeros = lambda *a: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *a))  # noqa: E731
    return jax.lax.cond(flag, fn, zeros, *args)


def choose(logits: jax.Array, p: RowParams, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next token per row and its log-prob under the unmodified model distribution."""
    scaled = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    filtering = jnp.any((p.top_k > 0) | (p.top_p < 1))
    scaled = jax.lax.cond(filtering, _filter_top_k_top_p, lambda s, k, q: s, scaled, p.top_k, p.top_p)
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    drawn = _inverse_cdf(weights, _uniforms(p, step))
    token = jnp.where(p.temperature == 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return token, jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - lse


def is_stop(token: jax.Array, p: RowParams) -> jax.Array:
    return jnp.any(token[:, None] == p.stop_ids, axis=-1)
