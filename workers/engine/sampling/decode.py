"""The sampler's device programs: decode-slot state and the jitted admit and decode steps.

The host scheduler in `sampler.py` (`SlotSampler`) decides which row goes into which slot and when; everything here
runs on the device, under `jax.jit`, on fixed shapes. How a token and its logprob are chosen is `token_choice.py`'s,
kept apart so the numerics can be read and checked without the programs around them.

`Slots` is the state of a fixed number of decode slots: one shared KV cache, each slot's sampling parameters
(`RowParams`), adapter index into a small stack of snapshot LoRAs (dense matmuls over the stack, see
`StackedLoraRouting`), position, generated tokens and logprobs, and room for the top-k tokens at every sampled
position (filled where a row asks). `admit` prefills newly admitted rows into their slots, from the prefix cache's
blocks where a row's prompt starts with cached ones (prefix_cache.py), and in a scoring admission scores the prompt
(prompt_scoring.py); `decode` runs a chunk of decode steps over all slots at once. Stop token ids are checked here,
on device."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..model.decoder_stack import DecodeLayers
from ..model.families import ModelConfig
from ..model.image_inputs import PromptImages, feature_width, takes_images
from ..model.logprobs import chunk_tokens, scored_next
from ..model.lora import StackedLoraRouting
from ..model.sharding import DeviceLayout
from ..model.slot_cache import empty_prefix_pool, empty_slot_cache, recurrent
from .buckets import STOP_IDS
from .prefix_cache import BLOCK, state_slots
from .prompt_scoring import alt_tokens, target_prompt_logprobs
from .token_choice import RowParams, choose, is_stop, top_tokens, when

# Prompt scoring always computes this many top tokens per prompt position (one compiled program whatever k a
# request asks for); each row keeps its own k <= this. Distillation recipes ask for k around 20.
MAX_TOPK_PROMPT_LOGPROBS = 20
# Sampled positions keep at most this many top tokens (topk_sample_logprobs): every slot set has room for them, and
# they are computed only in steps where some row asks (one program whether or not any does).
MAX_TOPK_SAMPLE_LOGPROBS = 20
# Prompt draws a scoring admission computes per position (`prompt_alt_tokens_k`: each row keeps its first k), and
# the target ids it scores per position (`target_prompt_logprobs`; a request naming more is its error; its cost is
# len(prompt) x this): one width each, so what a row asks never selects a program.
MAX_ALT_TOKENS = 20
MAX_TARGET_PROMPT_LOGPROBS = 64


@jax.tree_util.register_dataclass
@dataclass
class Slots:
    """The decode slots: KV cache, per-slot parameters and routing, and generation state. Free slots are done."""

    # The model's slot cache (model/slot_cache.py): keys/values [kv layers, B, L, kv_heads, head_dim] as `k`, `v`,
    # and a recurrent model's per-slot states beside them.
    cache: Any
    params: RowParams
    adapter: jax.Array  # int32 [B]: index into the LoRA stack, -1 = base model
    scale: jax.Array  # float32 [B]
    last_token: jax.Array  # int32 [B]: the token to feed next
    pos: jax.Array  # int32 [B]: its position
    # int32 [B]: a vision-language model's rope delta (prompt_images.py): the token's rotary position minus `pos`
    delta: jax.Array
    n_gen: jax.Array  # int32 [B]: tokens generated so far
    done: jax.Array  # bool [B]
    hit_stop_id: jax.Array  # bool [B]: finished on a stop token (vs. max_tokens)
    tokens: jax.Array  # int32 [B, L]
    logprobs: jax.Array  # float32 [B, L]
    top_ids: jax.Array  # int32 [B, L, K]: the K most likely tokens at each sampled position (zeros unless asked)
    top_lp: jax.Array  # float32 [B, L, K]


def _constrain(slots: Slots, placement: DeviceLayout) -> Slots:
    """Pin the slots to their layout (cache rows on fsdp and kv heads on tp, the rest rows on fsdp), so every
    compiled function takes and returns the same shardings."""
    cache_sharding = placement.cache_sharding()
    kv = slots.cache
    k, v = (jax.lax.with_sharding_constraint(x, cache_sharding) for x in (kv.k, kv.v))
    cache = kv._replace(k=k, v=v)
    rest = placement.constrain_batch({k: v for k, v in vars(slots).items() if k != "cache"})
    return Slots(cache=cache, **rest)


def empty_slots(config: ModelConfig, dtype: Any, placement: DeviceLayout, *, slots: int, cache_len: int) -> Slots:
    b = slots
    zeros = lambda shape, dt: jnp.zeros(shape, dt)  # noqa: E731
    params = RowParams(
        temperature=zeros((b,), jnp.float32),
        top_k=zeros((b,), jnp.int32),
        top_p=jnp.ones((b,), jnp.float32),
        seed=zeros((b, 2), jnp.uint32),
        sample_index=zeros((b,), jnp.int32),
        max_tokens=jnp.ones((b,), jnp.int32),
        stop_ids=jnp.full((b, STOP_IDS), -1, jnp.int32),
        topk=zeros((b,), jnp.int32),
    )
    out = Slots(
        cache=empty_slot_cache(config, b, cache_len, dtype),
        params=params,
        adapter=jnp.full((b,), -1, jnp.int32),
        scale=zeros((b,), jnp.float32),
        last_token=zeros((b,), jnp.int32),
        pos=zeros((b,), jnp.int32),
        delta=zeros((b,), jnp.int32),
        n_gen=zeros((b,), jnp.int32),
        done=jnp.ones((b,), bool),
        hit_stop_id=zeros((b,), bool),
        tokens=zeros((b, cache_len), jnp.int32),
        logprobs=zeros((b, cache_len), jnp.float32),
        top_ids=zeros((b, cache_len, MAX_TOPK_SAMPLE_LOGPROBS), jnp.int32),
        top_lp=zeros((b, cache_len, MAX_TOPK_SAMPLE_LOGPROBS), jnp.float32),
    )
    return _constrain(out, placement)


def pool_program(config: ModelConfig, dtype: Any, prefix_tokens: int) -> Any:
    """The jitted program that makes the pool for `prefix_tokens` of prefix cache (one block at least; a recurrent
    model's with its state slots, prefix_cache.py): run once by the sampler, and compiled (never run) for its shapes
    by a warm-up from shapes."""
    blocks = max(1, prefix_tokens // BLOCK)
    states = state_slots(blocks) if recurrent(config) else 0
    return jax.jit(partial(empty_prefix_pool, config, blocks, BLOCK, states, dtype))


def admit(
    graphdef: nnx.GraphDef,
    placement: DeviceLayout,
    lora: Any,
    base: Any,
    slots: Slots,
    pool: Any,  # the prefix cache's blocks `k`, `v` [L, N, BLOCK, KV, D] (and a recurrent model's state slots)
    chunk: jax.Array,  # int32 [R, C]: prompt tokens at positions start .. start + C - 1 (anything past the prompt)
    nexts: jax.Array,  # int32 [R, C]: the prompt token after each of those positions (-1: none), for scoring
    start: jax.Array,  # int32 [R]: the position of chunk[:, 0]
    prompt_len: jax.Array,  # int32 [R]
    index: jax.Array,  # int32 [R]: the slot each row fills; out of range (= slots) for padding rows
    final: jax.Array,  # bool [R]: the row's last prompt token is in this chunk: its first token is sampled
    params: RowParams,  # [R]
    adapter: jax.Array,  # int32 [R]
    scale: jax.Array,  # float32 [R]
    cached: jax.Array,  # int32 [R]: prompt tokens copied from the pool into the slot before this chunk (0: none)
    read: jax.Array,  # int32 [R, NB]: the pool blocks of those tokens (NB = cache length / BLOCK)
    write: jax.Array,  # int32 [R, C / BLOCK]: the pool block of each whole block of this chunk (out of range: none)
    targets: jax.Array,  # int32 [R, C, K]: target ids per position, predicting the next token (-1: none; K = 0: none)
    wants: jax.Array,  # bool [3]: some row asks for prompt logprobs, target logprobs, prompt draws
    resume: jax.Array,  # int32 [R]: the pool's state slot a row's recurrent state resumes from (out of range: none)
    snap: jax.Array,  # int32 [R]: the pool's state slot the row's state after this chunk goes to (out of range: none)
    images: PromptImages | None,  # a vision-language model's: the chunk's features and 3-D positions (else None)
    delta: jax.Array | None,  # int32 [R]: with `images`, each row's rope delta
    *,
    scoring: bool,
    decode_layers: DecodeLayers = "scan",
) -> tuple[Slots, Any, dict[str, jax.Array]]:
    """Prefill one chunk of C prompt tokens of R rows straight into their slots of the shared KV cache; rows whose
    prompt ends in it sample their first token and have their state written into their slots.

    A prompt of any length is prefilled in chunks of one size, so one program per slot bucket serves every prompt
    length, with or without prefix-cache hits (sampler.py: the bounded program set). A row that starts in the
    prefix cache has its cached blocks copied from the pool into its slot first (`cached`, `read`: its first chunk
    only, a chunk's length at a time up to the longest hit) and is prefilled from there; every whole block a chunk
    computes is written to the pool where `write` says. On a recurrent model such a row's layer states are first
    set to the pool's snapshot (`resume`), and a row whose chunk ends at a block boundary it snapshots leaves its
    states there in the pool (`snap`).

    A `scoring` admission also returns, by name, what is scored on the chunk's positions (entry t predicts the
    token at start + t + 1), each computed only when `wants` says some row asks and zeros otherwise: `token_lp`
    [R, C] and the MAX_TOPK_PROMPT_LOGPROBS most likely tokens `top_ids`, `top_lp` [R, C, K]; `target_lp`
    [R, C, MAX_TARGET_PROMPT_LOGPROBS]; MAX_ALT_TOKENS draws `alt_ids`, `alt_lp` [R, C, MAX_ALT_TOKENS].

    `decode_layers`: how the model's stacked layers run (decoder_stack.py), as in `decode`.
    """
    model = _merged(graphdef, lora, base, decode_layers)
    r, c = chunk.shape
    b = slots.done.shape[0]
    routing = StackedLoraRouting(adapter=adapter, scale=scale)

    # Rows' cached prompt blocks, from the pool into their slots: C tokens (C / BLOCK blocks) at a time, up to the
    # longest hit, so the copy follows what was cached and not the cache's length.
    groups = read.reshape(r, -1, c // BLOCK)

    def copy_in(g, cache: Any) -> Any:
        cols = g * c + jnp.arange(c)
        keep = (cols[None, :] < cached[:, None])[None, :, :, None, None]  # [1, R, C, 1, 1]
        blocks = jax.lax.dynamic_index_in_dim(groups, g, axis=1, keepdims=False)  # [R, C / BLOCK]

        def one(dst, src):
            got = src[:, blocks].reshape(src.shape[0], r, c, *src.shape[3:]).astype(dst.dtype)
            at = (slice(None), index[:, None], cols[None, :])
            old = dst.at[at].get(mode="fill", fill_value=0)
            return dst.at[at].set(jnp.where(keep, got, old), mode="drop")

        return cache._replace(k=one(cache.k, pool.k), v=one(cache.v, pool.v))

    cache = jax.lax.fori_loop(0, (jnp.max(cached) + c - 1) // c, copy_in, slots.cache)
    states = hasattr(pool, "recurrent")  # static: the pool keeps recurrent-state snapshots
    if states:
        cache = cache.resumed(pool, index, resume)
    positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    # A recurrent layer's state takes only the prompt's tokens, and a row's first chunk starts from zero state.
    real = jnp.clip(prompt_len - start, 0, c)
    view_in = cache.through(index, real, start == 0)
    if images is None:
        h, view = model.hidden(chunk, positions, routing, view_in)
    else:  # the tower's features at the placeholders and the multimodal rope; keys still go at `positions`
        h, view = model.hidden(chunk, positions, routing, view_in, prompt_images=images)
    cache = view.settled()

    def copy_out(pool: Any) -> Any:  # this chunk's whole blocks, from the slots into the pool
        def one(dst, src):
            got = src.at[:, index[:, None], positions].get(mode="fill", fill_value=0)  # [L, R, C, KV, D]
            blocks = got.reshape(src.shape[0], r * (c // BLOCK), BLOCK, *src.shape[3:])
            return dst.at[:, write.reshape(-1)].set(blocks.astype(dst.dtype), mode="drop")

        return pool._replace(k=one(pool.k, cache.k), v=one(pool.v, cache.v))

    pool = jax.lax.cond(jnp.any(write < pool.k.shape[1]), copy_out, lambda x: x, pool)
    if states:
        pool = pool.with_snapshots(cache, index, snap)

    last = jnp.take_along_axis(h, jnp.clip(prompt_len - start - 1, 0, c - 1)[:, None, None], axis=1)  # [R, 1, H]
    logits = model.logits(last, routing)[:, 0]
    token, lp = choose(logits, params, jnp.zeros((r,), jnp.int32))
    top_ids, top_lp = top_tokens(logits, slots.top_ids.shape[2], jnp.any(final & (params.topk > 0)))
    hit = is_stop(token, params)
    length = slots.tokens.shape[1]
    into = jnp.where(final, index, b)  # only rows whose prompt ended take their slot's state now

    def put(dst, src):
        return dst.at[into].set(src.astype(dst.dtype), mode="drop")

    out = Slots(
        cache=cache,
        params=jax.tree.map(put, slots.params, params),
        adapter=put(slots.adapter, adapter),
        scale=put(slots.scale, scale),
        last_token=put(slots.last_token, token),
        pos=put(slots.pos, prompt_len),
        delta=slots.delta if delta is None else put(slots.delta, delta),
        n_gen=put(slots.n_gen, jnp.ones((r,), jnp.int32)),
        done=put(slots.done, hit | (params.max_tokens <= 1)),
        hit_stop_id=put(slots.hit_stop_id, hit),
        tokens=put(slots.tokens, jnp.zeros((r, length), jnp.int32).at[:, 0].set(token)),
        logprobs=put(slots.logprobs, jnp.zeros((r, length), jnp.float32).at[:, 0].set(lp)),
        top_ids=put(slots.top_ids, jnp.zeros((r, length, top_ids.shape[1]), jnp.int32).at[:, 0].set(top_ids)),
        top_lp=put(slots.top_lp, jnp.zeros((r, length, top_lp.shape[1]), jnp.float32).at[:, 0].set(top_lp)),
    )
    # The vocabulary read in chunks of positions: a long chunk's logits never exist whole.
    vocab = model.config.vocab_size
    per = chunk_tokens(r, vocab)
    scores: dict[str, jax.Array] = {}
    if scoring:
        k = min(MAX_TOPK_PROMPT_LOGPROBS, vocab)
        scores["token_lp"], scores["top_ids"], scores["top_lp"] = when(
            wants[0], lambda x: scored_next(model, x, nexts, routing, k, per), h
        )
        scores["target_lp"] = when(wants[1], lambda x: target_prompt_logprobs(model, x, targets, routing, per), h)

        def draws(x):
            chunk = max(1, per // MAX_ALT_TOKENS)
            return alt_tokens(model, x, routing, MAX_ALT_TOKENS, params.temperature, params.seed, chunk, positions)

        scores["alt_ids"], scores["alt_lp"] = when(wants[2], draws, h)
    return _constrain(out, placement), pool, placement.constrain_batch(scores)


def decode(
    graphdef: nnx.GraphDef,
    placement: DeviceLayout,
    lora: Any,
    base: Any,
    slots: Slots,
    release: jax.Array,  # bool [B]: slots the host finished (stop strings); marked done first
    steps: jax.Array,  # int32 scalar
    target_done: jax.Array,  # int32 scalar
    *,
    decode_layers: DecodeLayers = "scan",
) -> Slots:
    """Up to `steps` decode steps over every slot, stopping early once `target_done` slots are done (free slots
    count as done); finished rows keep their state. `decode_layers`: how the model's stacked layers run, the scan or
    unrolled over static slices (decoder_stack.py); a model without a stack loops over its layers either way."""
    model = _merged(graphdef, lora, base, decode_layers)
    rows = jnp.arange(slots.tokens.shape[0])
    length = slots.tokens.shape[1]
    p = slots.params
    routing = StackedLoraRouting(adapter=slots.adapter, scale=slots.scale)

    vision = takes_images(model.config)

    def step(carry):
        i, s = carry
        if vision:  # every axis at the slot's position plus its rope delta (no placeholders among sampled tokens)
            token = s.last_token[:, None]
            at = jnp.repeat((s.pos + s.delta)[:, None, None], 3, axis=2)
            zero = jnp.zeros((*token.shape, feature_width(model.config)), jnp.float32)
            images = PromptImages(features=zero, mask=jnp.zeros(token.shape, bool), positions=at)
            h, cache = model.hidden(token, s.pos[:, None], routing, s.cache, prompt_images=images)
        else:
            h, cache = model.hidden(s.last_token[:, None], s.pos[:, None], routing, s.cache)
        logits = model.logits(h, routing)[:, 0]
        token, lp = choose(logits, p, s.n_gen)
        active = ~s.done
        top_ids, top_lp = top_tokens(logits, s.top_ids.shape[2], jnp.any(active & (p.topk > 0)))
        col = jnp.minimum(s.n_gen, length - 1)
        hit = is_stop(token, p) & active
        n_gen = s.n_gen + active
        return i + 1, Slots(
            cache=cache,
            params=p,
            adapter=s.adapter,
            scale=s.scale,
            last_token=jnp.where(active, token, s.last_token),
            pos=s.pos + active,
            delta=s.delta,
            n_gen=n_gen,
            done=s.done | hit | (n_gen >= p.max_tokens),
            hit_stop_id=s.hit_stop_id | hit,
            tokens=s.tokens.at[rows, col].set(jnp.where(active, token, s.tokens[rows, col])),
            logprobs=s.logprobs.at[rows, col].set(jnp.where(active, lp, s.logprobs[rows, col])),
            top_ids=s.top_ids.at[rows, col].set(jnp.where(active[:, None], top_ids, s.top_ids[rows, col])),
            top_lp=s.top_lp.at[rows, col].set(jnp.where(active[:, None], top_lp, s.top_lp[rows, col])),
        )

    def more(carry):
        i, s = carry
        return (i < steps) & (jnp.sum(s.done) < target_done)

    slots = Slots(**{**vars(slots), "done": slots.done | release})
    _, slots = jax.lax.while_loop(more, step, (jnp.int32(0), slots))
    return _constrain(slots, placement)


def _merged(graphdef: nnx.GraphDef, lora: Any, base: Any, decode_layers: DecodeLayers) -> Any:
    """The model of these weights, running its stacked layers with a KV cache as `decode_layers` says (a static
    setting of the model, decoder.CausalLM's: set here, per program, so one engine's model serves both choices)."""
    model = nnx.merge(graphdef, lora, base)
    model.decode_layers = decode_layers
    return model
