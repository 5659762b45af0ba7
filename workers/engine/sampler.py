"""Continuous-batching sampler: a fixed set of decode slots, rows admitted into free slots, KV-cache decoding.

Every sample of every request is one *row*. A `sample` call queues its rows; `SlotSampler.run` admits them into a
fixed number of decode slots (a row bucket such as 8/64/256), prefills the newly admitted rows (their keys and values
are written into their slots' part of the one shared KV cache), and runs jitted decode chunks over all slots at once.
A row that finishes frees its slot; waiting rows are admitted at the next chunk boundary. Rows of different
snapshots share decode steps: each slot carries its adapter index into a small stack of snapshot LoRAs (dense
matmuls over the stack, see `StackedLoraRouting`), its own position, sampling parameters, PRNG stream and stop ids.

Shapes are bucketed so a steady workload compiles nothing new: slots (a few row buckets), cache length (a power of
two, at least MIN_CACHE_LEN), prompt length (round_up_seq_len), stop-id width and
adapter-stack size (powers of two); admissions always take slots/8 rows (several calls fill the slots). With
`eager_buckets` the first use of a (cache, prompt, adapters, stops) family compiles the decode chunk and the
admission for every slot bucket, so coordinator batches of varying size
(4 rows, then 252, ...) never compile in the middle of a workload; `warm_up` does the same ahead of time.

A row's randomness depends only on (seed, sample index, token index): one uniform per row and step, turned into a
token by inverse-CDF over the (temperature-scaled, top-k/top-p-filtered) distribution, so a seed reproduces its
samples whatever else is in the batch. top-k/top-p filtering (a full-vocab sort) runs only in steps where some row
uses it. Stop token ids are checked on device; stop strings on the host between chunks (only when some row has them).

Reported logprobs are log_softmax of the unmodified logits (temperature 1, no top-k/top-p), the quantity the
trainer computes, so sampler and trainer agree for the same weights.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tinkerflow.common.settings import env_setting

from .config import ModelConfig, round_up_pow2, round_up_seq_len
from .jit_cache import AotCache
from .lora import StackedLoraRouting
from .model import LayerCache, empty_cache
from .sharding import Placement

log = logging.getLogger(__name__)

# Largest number of decode slots (rows decoded together); smaller buckets are powers of 8 below it.
DEFAULT_SAMPLE_SLOTS = 256
# Decode steps between host checks of stop strings (only when some row has stop strings).
STOP_STRING_CHUNK = 16
# Smallest KV-cache length bucket (cache lengths are powers of two).
MIN_CACHE_LEN = 128
# Smallest stop-id width (stop lists are padded with -1 to a power of two).
MIN_STOP_IDS = 8
# Block size of the two-level inverse-CDF search.
_CDF_BLOCK = 64
# Prompt scoring always computes this many top tokens per prompt position (one compiled program whatever k a
# request asks for); each row keeps its own k <= this. Distillation recipes ask for k around 20.
MAX_TOPK_PROMPT_LOGPROBS = 20


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


@jax.tree_util.register_dataclass
@dataclass
class Slots:
    """The decode slots: KV cache, per-slot parameters and routing, and generation state. Free slots are done."""

    cache: list[LayerCache]  # [B, L, kv_heads, head_dim] per layer
    params: RowParams
    adapter: jax.Array  # int32 [B]: index into the LoRA stack, -1 = base model
    scale: jax.Array  # float32 [B]
    last_token: jax.Array  # int32 [B]: the token to feed next
    pos: jax.Array  # int32 [B]: its position
    n_gen: jax.Array  # int32 [B]: tokens generated so far
    done: jax.Array  # bool [B]
    hit_stop_id: jax.Array  # bool [B]: finished on a stop token (vs. max_tokens)
    tokens: jax.Array  # int32 [B, L]
    logprobs: jax.Array  # float32 [B, L]


# ---------------------------------------------------------------------------------------------- device functions


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


def _choose(logits: jax.Array, p: RowParams, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next token per row and its log-prob under the unmodified model distribution."""
    scaled = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    filtering = jnp.any((p.top_k > 0) | (p.top_p < 1))
    scaled = jax.lax.cond(filtering, _filter_top_k_top_p, lambda s, k, q: s, scaled, p.top_k, p.top_p)
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    drawn = _inverse_cdf(weights, _uniforms(p, step))
    token = jnp.where(p.temperature == 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return token, jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - lse


def _is_stop(token: jax.Array, p: RowParams) -> jax.Array:
    return jnp.any(token[:, None] == p.stop_ids, axis=-1)


def _constrain(slots: Slots, placement: Placement) -> Slots:
    """Pin the slots to their layout (cache rows on fsdp and kv heads on tp, the rest rows on fsdp), so every
    compiled function takes and returns the same shardings."""
    cache_sharding = placement.cache_sharding()
    cache = [LayerCache(*(jax.lax.with_sharding_constraint(x, cache_sharding) for x in c)) for c in slots.cache]
    rest = placement.constrain_batch({k: v for k, v in vars(slots).items() if k != "cache"})
    return Slots(cache=cache, **rest)


def empty_slots(config: ModelConfig, dtype: Any, placement: Placement, *, slots: int, cache_len: int, stops: int) -> Slots:
    b = slots
    zeros = lambda shape, dt: jnp.zeros(shape, dt)  # noqa: E731
    params = RowParams(
        temperature=zeros((b,), jnp.float32), top_k=zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32),
        seed=zeros((b, 2), jnp.uint32), sample_index=zeros((b,), jnp.int32), max_tokens=jnp.ones((b,), jnp.int32),
        stop_ids=jnp.full((b, stops), -1, jnp.int32),
    )  # fmt: skip
    out = Slots(
        cache=empty_cache(config, b, cache_len, dtype), params=params,
        adapter=jnp.full((b,), -1, jnp.int32), scale=zeros((b,), jnp.float32),
        last_token=zeros((b,), jnp.int32), pos=zeros((b,), jnp.int32), n_gen=zeros((b,), jnp.int32),
        done=jnp.ones((b,), bool), hit_stop_id=zeros((b,), bool),
        tokens=zeros((b, cache_len), jnp.int32), logprobs=zeros((b, cache_len), jnp.float32),
    )  # fmt: skip
    return _constrain(out, placement)


def admit(
    graphdef: nnx.GraphDef,
    placement: Placement,
    lora: Any,
    base: Any,
    slots: Slots,
    prompt: jax.Array,  # int32 [R, P]
    prompt_len: jax.Array,  # int32 [R]
    index: jax.Array,  # int32 [R]: the slot each row goes to; out of range (= slots) for padding rows
    params: RowParams,  # [R]
    adapter: jax.Array,  # int32 [R]
    scale: jax.Array,  # float32 [R]
    *,
    prompt_logprobs: bool,
) -> tuple[Slots, tuple[jax.Array, jax.Array, jax.Array] | None]:
    """Prefill R new rows, sample their first token and write them (cache, parameters, state) into their slots.

    With `prompt_logprobs`, also scores the prompt: (log-prob of each prompt token [R, P-1], and the
    MAX_TOPK_PROMPT_LOGPROBS most likely tokens at each position, ids and log-probs [R, P-1, K]).
    """
    model = nnx.merge(graphdef, lora, base)
    r, plen = prompt.shape
    routing = StackedLoraRouting(adapter=adapter, scale=scale)
    positions = jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), (r, plen))
    local = empty_cache(model.config, r, plen, model.dtype)
    h, local = model.hidden(prompt, positions, routing, local)
    last = jnp.take_along_axis(h, (prompt_len - 1)[:, None, None], axis=1)  # [R, 1, H]
    logits = model.logits(last, routing)[:, 0]
    token, lp = _choose(logits, params, jnp.zeros((r,), jnp.int32))
    hit = _is_stop(token, params)
    length = slots.tokens.shape[1]

    def put(dst, src):
        return dst.at[index].set(src.astype(dst.dtype), mode="drop")

    cols = jnp.arange(plen)[None, :]
    cache = [
        LayerCache(
            old.k.at[index[:, None], cols].set(new.k.astype(old.k.dtype), mode="drop"),
            old.v.at[index[:, None], cols].set(new.v.astype(old.v.dtype), mode="drop"),
        )
        for old, new in zip(slots.cache, local)
    ]
    out = Slots(
        cache=cache,
        params=jax.tree.map(put, slots.params, params),
        adapter=put(slots.adapter, adapter),
        scale=put(slots.scale, scale),
        last_token=put(slots.last_token, token),
        pos=put(slots.pos, prompt_len),
        n_gen=put(slots.n_gen, jnp.ones((r,), jnp.int32)),
        done=put(slots.done, hit | (params.max_tokens <= 1)),
        hit_stop_id=put(slots.hit_stop_id, hit),
        tokens=put(slots.tokens, jnp.zeros((r, length), jnp.int32).at[:, 0].set(token)),
        logprobs=put(slots.logprobs, jnp.zeros((r, length), jnp.float32).at[:, 0].set(lp)),
    )
    prompt_lp = None
    if prompt_logprobs:
        full = jax.nn.log_softmax(model.logits(h, routing), axis=-1)
        token_lp = jnp.take_along_axis(full[:, :-1], prompt[:, 1:, None], axis=-1)[..., 0]  # [R, P-1]
        top_lp, top_ids = jax.lax.top_k(full[:, :-1], min(MAX_TOPK_PROMPT_LOGPROBS, full.shape[-1]))
        prompt_lp = placement.constrain_batch((token_lp, top_ids.astype(jnp.int32), top_lp))
    return _constrain(out, placement), prompt_lp


def decode(
    graphdef: nnx.GraphDef,
    placement: Placement,
    lora: Any,
    base: Any,
    slots: Slots,
    release: jax.Array,  # bool [B]: slots the host finished (stop strings); marked done first
    steps: jax.Array,  # int32 scalar
    target_done: jax.Array,  # int32 scalar
) -> Slots:
    """Up to `steps` decode steps over every slot, stopping early once `target_done` slots are done (free slots
    count as done); finished rows keep their state."""
    model = nnx.merge(graphdef, lora, base)
    rows = jnp.arange(slots.tokens.shape[0])
    length = slots.tokens.shape[1]
    p = slots.params
    routing = StackedLoraRouting(adapter=slots.adapter, scale=slots.scale)

    def step(carry):
        i, s = carry
        h, cache = model.hidden(s.last_token[:, None], s.pos[:, None], routing, s.cache)
        logits = model.logits(h, routing)[:, 0]
        token, lp = _choose(logits, p, s.n_gen)
        active = ~s.done
        col = jnp.minimum(s.n_gen, length - 1)
        hit = _is_stop(token, p) & active
        n_gen = s.n_gen + active
        return i + 1, Slots(
            cache=cache,
            params=p,
            adapter=s.adapter,
            scale=s.scale,
            last_token=jnp.where(active, token, s.last_token),
            pos=s.pos + active,
            n_gen=n_gen,
            done=s.done | hit | (n_gen >= p.max_tokens),
            hit_stop_id=s.hit_stop_id | hit,
            tokens=s.tokens.at[rows, col].set(jnp.where(active, token, s.tokens[rows, col])),
            logprobs=s.logprobs.at[rows, col].set(jnp.where(active, lp, s.logprobs[rows, col])),
        )

    def more(carry):
        i, s = carry
        return (i < steps) & (jnp.sum(s.done) < target_done)

    slots = Slots(**{**vars(slots), "done": slots.done | release})
    _, slots = jax.lax.while_loop(more, step, (jnp.int32(0), slots))
    return _constrain(slots, placement)


# ---------------------------------------------------------------------------------------------- host side


@dataclass
class SampleRow:
    """One sample of one request, as the host queues it."""

    prompt: np.ndarray  # int32 [P]
    max_tokens: int  # already clamped to the context
    temperature: float
    top_k: int
    top_p: float
    seed: tuple[int, int]
    sample_index: int
    stop_ids: list[int]
    adapter: int  # index into the LoRA stack; -1 = base model
    scale: float
    prompt_logprobs: bool = False
    stop_strings: list[str] = field(default_factory=list)
    topk_prompt_logprobs: int = 0  # > 0 (with prompt_logprobs): also keep this many top tokens per prompt position


@dataclass
class RowOutput:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    prompt_logprobs: list[float] | None = None  # [P - 1], for rows that asked
    # (token ids int32 [P - 1, k], log-probs float32 [P - 1, k]), for rows that asked for k > 0
    topk_prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None


def slot_buckets(max_slots: int, placement: Placement) -> list[int]:
    """Row buckets: powers of 8 below max_slots, then max_slots (e.g. 8, 64, 256), each a multiple of fsdp."""
    out, b = [], 8
    while b < max_slots:
        out.append(b)
        b *= 8
    out.append(max_slots)
    return sorted({placement.round_rows(x) for x in out})


def admission_rows(slots: int, placement: Placement) -> int:
    """Rows per admission call (slots / 8): filling every slot takes 8 calls, a refill one; one program per bucket."""
    return placement.round_rows(max(1, slots // 8))


class SlotSampler:
    """Host driver of the decode slots (see the module docstring). One thread at a time, like the engine."""

    def __init__(self, graphdef: nnx.GraphDef, placement: Placement, config: ModelConfig, dtype: Any, tokenizer: Any):
        self.placement = placement
        self.config = config
        self.tokenizer = tokenizer
        self.max_slots = DEFAULT_SAMPLE_SLOTS
        # Compile every slot bucket and admission size of a shape family at its first use (see module docstring).
        # (TINKERFLOW_SAMPLER_EAGER_BUCKETS=0, an env-only Settings field, compiles each bucket when first needed.)
        self.eager_buckets = bool(env_setting("sampler_eager_buckets"))
        self._admit = AotCache("sample_admit", partial(admit, graphdef, placement), donate=("slots",))
        self._decode = AotCache("sample_decode", partial(decode, graphdef, placement), donate=("slots",))
        self._empty = AotCache("sample_slots", partial(empty_slots, config, dtype, placement))
        self._idle: dict[tuple[int, int, int], tuple[Slots, np.ndarray]] = {}  # (B, L, M) -> slots, pending release
        self._families: set[tuple] = set()

    def caches(self) -> list[AotCache]:
        return [self._admit, self._decode, self._empty]

    def compile_count(self) -> int:
        return sum(len(c._compiled) for c in self.caches())

    # -------------------------------------------------------------- buckets

    def buckets(self) -> list[int]:
        return slot_buckets(self.max_slots, self.placement)

    @staticmethod
    def cache_len(rows: list[SampleRow]) -> int:
        return round_up_pow2(max(len(r.prompt) + r.max_tokens for r in rows), minimum=MIN_CACHE_LEN)

    @staticmethod
    def stop_width(rows: list[SampleRow]) -> int:
        return round_up_pow2(max(1, *(len(r.stop_ids) for r in rows)), minimum=MIN_STOP_IDS)

    def _take(self, b: int, length: int, m: int) -> tuple[Slots, np.ndarray]:
        got = self._idle.pop((b, length, m), None)
        if got is None:
            got = (self._empty(f"slots={b} cache={length} stops={m}", slots=b, cache_len=length, stops=m),
                   np.zeros((b,), bool))  # fmt: skip
        return got

    def _keep(self, slots: Slots, release: np.ndarray, length: int, m: int) -> None:
        """Keep the slots' buffers for the next call of the same shape. Only one (cache length, stop width) is kept
        (one set per slot bucket): KV caches of other lengths are let go rather than held side by side."""
        for key in [k for k in self._idle if k[1:] != (length, m)]:
            del self._idle[key]
        self._idle[(int(slots.done.shape[0]), length, m)] = (slots, release)

    # -------------------------------------------------------------- compiled calls

    def _admit_call(self, lora, base, slots: Slots, rows: list[SampleRow], chosen: list[int], index: list[int],
                    r: int, plen: int, plp: bool):  # fmt: skip
        b = int(slots.done.shape[0])
        m = int(slots.params.stop_ids.shape[1])
        prompt = np.zeros((r, plen), np.int32)
        prompt_len = np.ones((r,), np.int32)
        idx = np.full((r,), b, np.int32)
        adapter = np.full((r,), -1, np.int32)
        scale = np.zeros((r,), np.float32)
        temp, top_p = np.ones((r,), np.float32), np.ones((r,), np.float32)
        top_k, sample_index, max_tokens = np.full((r,), -1, np.int32), np.zeros((r,), np.int32), np.ones((r,), np.int32)
        seeds = np.zeros((r, 2), np.uint32)
        stop_ids = np.full((r, m), -1, np.int32)
        for i, (row_i, slot) in enumerate(zip(chosen, index)):
            row = rows[row_i]
            prompt[i, : len(row.prompt)] = row.prompt
            prompt_len[i] = len(row.prompt)
            idx[i] = slot
            adapter[i], scale[i] = row.adapter, row.scale
            temp[i], top_k[i], top_p[i] = row.temperature, row.top_k, row.top_p
            seeds[i] = row.seed
            sample_index[i] = row.sample_index
            max_tokens[i] = row.max_tokens
            stop_ids[i, : len(row.stop_ids)] = row.stop_ids
        put = self.placement.put_batch
        # numpy leaves, placed by put_batch; the fields name the traced type.
        params = put(RowParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seeds, sample_index=sample_index,  # pyright: ignore[reportArgumentType]
                               max_tokens=max_tokens, stop_ids=stop_ids))  # fmt: skip  # pyright: ignore[reportArgumentType]
        length = int(slots.tokens.shape[1])
        s = _stack_size(lora)
        label = f"slots={b} cache={length} adapters={s} stops={m} rows={r} prompt={plen}"
        return self._admit(label, lora, base, slots, put(prompt), put(prompt_len), put(idx), params, put(adapter),
                           put(scale), prompt_logprobs=plp)  # fmt: skip

    def _decode_call(self, lora, base, slots: Slots, release: np.ndarray, steps: int, target: int) -> Slots:
        b, length = (int(x) for x in slots.tokens.shape)
        label = f"slots={b} cache={length} adapters={_stack_size(lora)} stops={int(slots.params.stop_ids.shape[1])}"
        return self._decode(label, lora, base, slots, self.placement.put_batch(release), jnp.int32(steps),
                            jnp.int32(target))  # fmt: skip

    def _ensure_family(self, lora, base, length: int, m: int, plen: int, plp: bool) -> None:
        """Compile (by running on no rows) every slot bucket's decode chunk and admissions for this family."""
        family = (length, m, plen, plp, _stack_size(lora), tuple(self.buckets()))
        if family in self._families:
            return
        self._families.add(family)
        t0 = time.perf_counter()
        before = self.compile_count()
        for b in self.buckets():
            slots, release = self._take(b, length, m)
            slots, _ = self._admit_call(lora, base, slots, [], [], [], admission_rows(b, self.placement), plen, plp)
            slots = self._decode_call(lora, base, slots, np.zeros((b,), bool), 0, 0)
            self._keep(slots, release, length, m)
        if self.compile_count() > before:
            log.info("sampler: compiled %d programs for cache=%d stops=%d prompt=%d prompt_logprobs=%s adapters=%d "
                     "in %.1fs", self.compile_count() - before, length, m, plen, plp, family[4],
                     time.perf_counter() - t0)  # fmt: skip

    def warm_up(self, lora, base, *, cache_lens, prompt_lens, stop_width: int = MIN_STOP_IDS,
                prompt_logprobs: tuple[bool, ...] = (False,)) -> None:  # fmt: skip
        for length in cache_lens:
            for plen in prompt_lens:
                for plp in prompt_logprobs:
                    if plen <= length:
                        self._ensure_family(lora, base, length, stop_width, plen, plp)

    # -------------------------------------------------------------- the loop

    def run(self, rows: list[SampleRow], lora: Any, base: Any) -> list[RowOutput]:
        n = len(rows)
        buckets = self.buckets()
        b = next((x for x in buckets if x >= n), buckets[-1])
        length, m = self.cache_len(rows), self.stop_width(rows)
        small = admission_rows(b, self.placement)
        slots, release = self._take(b, length, m)
        queue = deque(range(n))
        free = deque(range(b))
        occupant: dict[int, int] = {}  # slot -> row
        results: list[RowOutput | None] = [None] * n
        checked: dict[int, int] = {}  # row -> tokens already checked for stop strings
        # (An exception leaves the slots out of the idle pool: their buffers may have been donated.)
        while queue or occupant:
            while queue and free:
                chosen = [queue.popleft() for _ in range(min(len(queue), len(free), small))]
                index = [free.popleft() for _ in chosen]
                plen = round_up_seq_len(max(len(rows[i].prompt) for i in chosen))
                plp = any(rows[i].prompt_logprobs for i in chosen)
                if self.eager_buckets:
                    self._keep(slots, release, length, m)
                    self._ensure_family(lora, base, length, m, plen, plp)
                    slots, release = self._take(b, length, m)
                slots, prompt_lp = self._admit_call(lora, base, slots, rows, chosen, index, small, plen, plp)
                host_lp = self.placement.to_host(prompt_lp) if prompt_lp is not None else None
                for j, (i, s) in enumerate(zip(chosen, index)):
                    occupant[s] = i
                    release[s] = False
                    if rows[i].prompt_logprobs:
                        assert host_lp is not None  # a row that asks makes plp true, so prompt_lp is set
                        results[i] = _prompt_scores(rows[i], j, host_lp)
            strings = any(rows[i].stop_strings for i in occupant.values())
            steps = STOP_STRING_CHUNK if strings else length
            target = b if not queue else min(b, b - len(occupant) + min(len(queue), small))
            slots = self._decode_call(lora, base, slots, release, steps, target)
            release = np.zeros((b,), bool)
            done, n_gen, hit, tokens, logprobs = self.placement.to_host(
                (slots.done, slots.n_gen, slots.hit_stop_id, slots.tokens, slots.logprobs))  # fmt: skip
            for s, i in list(occupant.items()):
                row, k = rows[i], int(n_gen[s])
                cut = None
                if row.stop_strings and checked.get(i, 0) < k:
                    # Decode the whole sequence: a stop string may span tokens of earlier chunks.
                    cut = first_stop_string_end(self.tokenizer, tokens[s, :k].tolist(), row.stop_strings, 0)
                    checked[i] = k
                if cut is None and not done[s]:
                    continue
                reason: Literal["stop", "length"] = "stop" if hit[s] else "length"
                if cut is not None and cut <= k:
                    k, reason = cut, "stop"
                    release[s] = not done[s]
                previous = results[i]
                results[i] = RowOutput(tokens[s, :k].tolist(), logprobs[s, :k].tolist(), reason,
                                       previous.prompt_logprobs if previous is not None else None,
                                       previous.topk_prompt_logprobs if previous is not None else None)  # fmt: skip
                del occupant[s]
                free.append(s)
        self._keep(slots, release, length, m)
        return results  # type: ignore[return-value]


def _prompt_scores(row: SampleRow, j: int, host: tuple[np.ndarray, np.ndarray, np.ndarray]) -> RowOutput:
    """Row j's prompt scores from an admission's host arrays, cut to its prompt length and its own k."""
    token_lp, top_ids, top_lp = host
    n, k = len(row.prompt) - 1, row.topk_prompt_logprobs
    topk = (top_ids[j, :n, :k].copy(), top_lp[j, :n, :k].copy()) if k > 0 else None
    return RowOutput([], [], "length", token_lp[j, :n].tolist(), topk)


def _stack_size(lora: Any) -> int:
    return int(jax.tree.leaves(lora)[0].shape[0])


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
