"""Batched sampling: one prefill over right-padded prompts, then KV-cache decoding in jitted chunks.

Every sample of every request is one row of a single decode batch; each row has its own LoRA (a snapshot or the
zero adapter), position, sampling parameters, PRNG stream and stop ids. A row's randomness depends only on
(seed, sample index, token index), so a seed reproduces its samples whatever else is in the batch. Stop token ids
are checked on device; stop strings on the host between chunks (only when some row has them).

Reported logprobs are log_softmax of the unmodified logits (temperature 1, no top-k/top-p), the quantity the
trainer computes, so sampler and trainer agree for the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .lora import LoraRouting
from .model import LayerCache, empty_cache
from .sharding import Placement


@jax.tree_util.register_dataclass
@dataclass
class RowParams:
    """Per-row sampling settings, padded to the row bucket."""

    temperature: jax.Array  # float32 [B]; 0 = greedy
    top_k: jax.Array  # int32 [B]; <= 0 = off
    top_p: jax.Array  # float32 [B]; 1 = off
    seed: jax.Array  # uint32 [B, 2] (low, high words)
    sample_index: jax.Array  # int32 [B]
    max_tokens: jax.Array  # int32 [B]
    stop_ids: jax.Array  # int32 [B, M]; -1 = unused


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    cache: list[LayerCache]
    last_token: jax.Array  # int32 [B]: the token to feed next
    pos: jax.Array  # int32 [B]: its position
    n_gen: jax.Array  # int32 [B]: tokens generated so far
    done: jax.Array  # bool [B]
    hit_stop_id: jax.Array  # bool [B]: finished on a stop token (vs. max_tokens)
    tokens: jax.Array  # int32 [B, MAXNEW]
    logprobs: jax.Array  # float32 [B, MAXNEW]


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


def _choose(logits: jax.Array, p: RowParams, step: jax.Array, filtering: bool) -> tuple[jax.Array, jax.Array]:
    """Next token per row and its log-prob under the unmodified model distribution."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    keys = jax.vmap(
        lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(s[0]), s[1]), i), t)
    )(p.seed, p.sample_index, step)
    scaled = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    if filtering:
        scaled = _filter_top_k_top_p(scaled, p.top_k, p.top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    token = jnp.where(p.temperature == 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _is_stop(token: jax.Array, p: RowParams) -> jax.Array:
    return jnp.any(token[:, None] == p.stop_ids, axis=-1)


def constrain_state(state: DecodeState, placement: Placement) -> DecodeState:
    """Pin the decode state to its layout (cache rows on fsdp and kv heads on tp, the rest rows on fsdp), so every
    compiled decode chunk takes and returns the same shardings."""
    cache_sharding = placement.cache_sharding()
    cache = [LayerCache(*(jax.lax.with_sharding_constraint(x, cache_sharding) for x in c)) for c in state.cache]
    rest = placement.constrain_batch({k: v for k, v in vars(state).items() if k != "cache"})
    return DecodeState(cache=cache, **rest)


def prefill(
    graphdef: nnx.GraphDef,
    placement: Placement,
    lora: Any,
    base: Any,
    prompt: jax.Array,  # int32 [B, P]
    prompt_len: jax.Array,  # int32 [B]
    routing: LoraRouting,
    params: RowParams,
    *,
    cache_len: int,
    max_new: int,
    filtering: bool,
    prompt_logprobs: bool,
) -> tuple[DecodeState, jax.Array | None]:
    model = nnx.merge(graphdef, lora, base)
    b, plen = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), (b, plen))
    cache = empty_cache(model.config, b, cache_len, model.dtype, placement.cache_sharding())
    h, cache = model.hidden(prompt, positions, routing, cache)
    last = jnp.take_along_axis(h, (prompt_len - 1)[:, None, None], axis=1)  # [B, 1, H]
    logits = model.logits(last, routing)[:, 0]
    token, lp = _choose(logits, params, jnp.zeros((b,), jnp.int32), filtering)
    hit = _is_stop(token, params)
    state = DecodeState(
        cache=cache,
        last_token=token,
        pos=prompt_len,
        n_gen=jnp.ones((b,), jnp.int32),
        done=hit | (params.max_tokens <= 1),
        hit_stop_id=hit,
        tokens=jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(token),
        logprobs=jnp.zeros((b, max_new), jnp.float32).at[:, 0].set(lp),
    )
    prompt_lp = None
    if prompt_logprobs:
        full = jax.nn.log_softmax(model.logits(h, routing), axis=-1)
        prompt_lp = jnp.take_along_axis(full[:, :-1], prompt[:, 1:, None], axis=-1)[..., 0]  # [B, P-1]
        prompt_lp = placement.constrain_batch(prompt_lp)
    return constrain_state(state, placement), prompt_lp


def decode(
    graphdef: nnx.GraphDef,
    placement: Placement,
    lora: Any,
    base: Any,
    routing: LoraRouting,
    params: RowParams,
    state: DecodeState,
    steps: jax.Array,
    *,
    filtering: bool,
) -> DecodeState:
    """Up to `steps` decode steps (fewer if every row finishes); finished rows keep their state."""
    model = nnx.merge(graphdef, lora, base)
    rows = jnp.arange(state.tokens.shape[0])
    max_new = state.tokens.shape[1]

    def step(carry):
        i, s = carry
        h, cache = model.hidden(s.last_token[:, None], s.pos[:, None], routing, s.cache)
        logits = model.logits(h, routing)[:, 0]
        token, lp = _choose(logits, params, s.n_gen, filtering)
        active = ~s.done
        slot = jnp.minimum(s.n_gen, max_new - 1)
        hit = _is_stop(token, params) & active
        n_gen = s.n_gen + active
        return i + 1, DecodeState(
            cache=cache,
            last_token=jnp.where(active, token, s.last_token),
            pos=s.pos + active,
            n_gen=n_gen,
            done=s.done | hit | (n_gen >= params.max_tokens),
            hit_stop_id=s.hit_stop_id | hit,
            tokens=s.tokens.at[rows, slot].set(jnp.where(active, token, s.tokens[rows, slot])),
            logprobs=s.logprobs.at[rows, slot].set(jnp.where(active, lp, s.logprobs[rows, slot])),
        )

    def more(carry):
        i, s = carry
        return (i < steps) & ~jnp.all(s.done)

    _, state = jax.lax.while_loop(more, step, (jnp.int32(0), state))
    return constrain_state(state, placement)


def seed_words(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32


def first_stop_string_end(tokenizer: Any, tokens: list[int], stops: list[str], checked: int) -> int | None:
    """Smallest k > checked such that the decoded tokens[:k] contain a stop string, else None."""
    if not any(s in tokenizer.decode(tokens) for s in stops):
        return None
    for k in range(max(checked, 0) + 1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return len(tokens)
