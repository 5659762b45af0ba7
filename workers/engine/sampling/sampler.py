"""Continuous-batching sampler, host side: a fixed set of decode slots, rows admitted into free slots, KV-cache
decoding.

Every sample of every request is one *row*. A `sample` call queues its rows; `SlotSampler.run` admits them into a
fixed number of decode slots (a row bucket such as 8/64/256), prefills the newly admitted rows' prompts in chunks of
one length straight into their slots' part of the one shared KV cache, and runs jitted decode chunks over all slots
at once. A row that finishes frees its slot; waiting rows are admitted at the next chunk boundary. Rows of different
snapshots share decode steps: each slot carries its adapter index into a small stack of snapshot LoRAs, its own
position, sampling parameters, PRNG stream and stop ids. The device programs (slot state, sampling maths, the
jitted admit and decode steps) are in `decode.py`; this module schedules rows onto them.

The program set is bounded by design: a program's shapes never depend on a prompt's length or on where it starts in
the prefix cache. A family is (cache length, stop-id width, adapter-stack size, prompt logprobs); each has, per slot
bucket, its empty slots, one admission (a chunk of `chunk_len(cache)` tokens of slots/8 rows) and one decode
chunk. Cache lengths are powers of four from MIN_CACHE_LEN (128, 512, 2,048, 8,192, ...), up to the model's context:
a row's cache is at most four times what it needs, and a model of 40,960 positions has six. docs/architecture.md
§The bounded program set counts them. With `eager_buckets` the first use of a family compiles every slot bucket's
programs, so coordinator batches of varying size (4 rows, then 252, ...) never compile in the middle of a workload;
`warm_up` does the same ahead of time, or from shapes alone beside the traffic. A family the JAX worker's background
warm-up is about to build (`scheduled_families`), and a family of caches past EAGER_CACHE_LEN, are the exceptions: a
request compiles its own slot bucket only.

Stop token ids are checked on device; stop strings here, on the host, between chunks (only when some row has them).
Which rows go into one admission, where their prompts start in the prefix cache and the arrays of each chunk are
`admission.py`'s; the records of rows and their outputs are `rows.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tinkerflow.common.settings import env_setting

from ..model.config import ModelConfig
from ..runtime.aot_cache import AotCache, abstract, warmed_bucket
from ..runtime.memory_plan import MemoryPlan
from ..runtime.sharding import DeviceLayout
from . import admission
from .admission import Admission, Chunk
from .buckets import (
    DEFAULT_SAMPLE_SLOTS,
    EAGER_CACHE_LEN,
    MIN_CACHE_LEN,
    STOP_IDS,
    admission_rows,
    cache_bucket,
    chunk_len,
    slot_buckets,
    stop_width,
)

# The device programs; MAX_TOPK_PROMPT_LOGPROBS, RowParams and Slots are re-exported for code that imported them here.
from .decode import (
    MAX_TOPK_PROMPT_LOGPROBS,
    MAX_TOPK_SAMPLE_LOGPROBS,
    RowParams,
    Slots,
    admit,
    decode,
    empty_slots,
    pool_program,
)
from .prefix_cache import BLOCK, PrefixIndex
from .rows import PromptScores, RowOutput, SampleRow, first_stop_string_end, seed_words

__all__ = [
    "DEFAULT_SAMPLE_SLOTS",
    "MAX_TOPK_PROMPT_LOGPROBS",
    "MIN_CACHE_LEN",
    "STOP_IDS",
    "STOP_STRING_CHUNK",
    "RowOutput",
    "RowParams",
    "SampleRow",
    "SlotSampler",
    "Slots",
    "admission_rows",
    "first_stop_string_end",
    "seed_words",
    "slot_buckets",
]

log = logging.getLogger(__name__)

# Decode steps between host checks of stop strings (only when some row has stop strings).
STOP_STRING_CHUNK = 16


class SlotSampler:
    """Host driver of the decode slots (see the module docstring). One thread at a time, like the engine."""

    def __init__(
        self, graphdef: nnx.GraphDef, placement: DeviceLayout, config: ModelConfig, dtype: Any, tokenizer: Any
    ):
        self.placement = placement
        self.config = config
        self.tokenizer = tokenizer
        self.max_slots = DEFAULT_SAMPLE_SLOTS
        # Compile every slot bucket of a shape family at its first use (see module docstring).
        # (TINKERFLOW_SAMPLER_EAGER_BUCKETS=0, an env-only Settings field, compiles each bucket when first needed.)
        self.eager_buckets = bool(env_setting("sampler_eager_buckets"))
        self._admit = AotCache("sample_admit", partial(admit, graphdef, placement), donate=("slots", "pool"))
        self._decode = AotCache("sample_decode", partial(decode, graphdef, placement), donate=("slots",))
        self._empty = AotCache("sample_slots", partial(empty_slots, config, dtype, placement))
        self._idle: dict[tuple[int, ...], tuple[Slots, np.ndarray]] = {}  # (B, L, M, K) -> slots, pending release
        self._families: set[tuple] = set()
        # Cache lengths the warm-up compiles (Engine.prefer_buckets): rows round up to them where they fit. Fixed at
        # start, whatever the warm-up got to, so a row's shapes never depend on timing.
        self.warmed_caches: frozenset[int] = frozenset()
        # (cache, stops, prompt_logprobs, adapters) families a background warm-up builds at every bucket soon.
        self.scheduled_families: frozenset[tuple[int, int, bool, int]] = frozenset()
        self._buckets_built: set[tuple] = set()
        # The device-memory plan (Engine sets it): slot buckets and prefill rows are sized to fit it.
        self.memory: MemoryPlan | None = None
        # The prefix cache (prefix_cache.py): `prefix_tokens` of pool, made at first use (0: no cache, and a pool
        # of one block nothing is ever written to).
        self.prefix_tokens = 0
        self.prefix: PrefixIndex | None = None
        self._pool: Any = None
        self._config, self._dtype = config, dtype

    def caches(self) -> list[AotCache]:
        return [self._admit, self._decode, self._empty]

    def compile_count(self) -> int:
        """Programs the sampler built so far, recompiles included: only grows, so a difference counts compiles."""
        return sum(c.compiles for c in self.caches())

    # -------------------------------------------------------------- buckets

    def buckets(self, cache_len: int | None = None) -> list[int]:
        """Slot buckets; with `cache_len`, those whose KV caches of that length fit the memory plan (at least one:
        the largest power of two that fits, when even the smallest bucket does not)."""
        every = slot_buckets(self.max_slots, self.placement)
        if cache_len is None or self.memory is None:
            return every
        cap = self.memory.kv_slots(cache_len)
        fit = [b for b in every if b <= cap]
        return fit or [self.placement.round_rows(1 << (max(1, cap).bit_length() - 1))]

    def admission_rows(self, b: int, cache_len: int) -> int:
        """Rows one admission call prefills in bucket `b`: slots / 8, fewer when their chunk's prefill would not fit
        beside the slots' KV caches (memory plan)."""
        rows = admission_rows(b, self.placement)
        if self.memory is not None:
            fit = self.memory.prefill_rows(chunk_len(cache_len), b, cache_len)
            rows = min(rows, self.placement.round_rows(1 << (fit.bit_length() - 1)))
        return rows

    def cache_len(self, rows: list[SampleRow]) -> int:
        """The KV-cache length bucket of rows: their longest prompt + max_tokens, rounded up to the next of the few
        cache lengths (buckets.py)."""
        need = max(len(r.prompt) + r.max_tokens for r in rows)
        return cache_bucket(need, self.config.max_position_embeddings)

    @staticmethod
    def stop_width(rows: list[SampleRow]) -> int:
        return stop_width(rows)

    @staticmethod
    def topk_width(rows: list[SampleRow]) -> int:
        """Top tokens the slots keep per sampled position: 0 unless some row asks, then the most any may ask (one
        width, so how many a row asks for never selects a program)."""
        return MAX_TOPK_SAMPLE_LOGPROBS if any(r.topk_sample_logprobs for r in rows) else 0

    def _take(self, b: int, length: int, m: int, kt: int = 0) -> tuple[Slots, np.ndarray]:
        got = self._idle.pop((b, length, m, kt), None)
        if got is None:
            label = f"slots={b} cache={length} stops={m} topk={kt}"
            got = (self._empty(label, slots=b, cache_len=length, stops=m, topk=kt), np.zeros((b,), bool))
        return got

    def _keep(self, slots: Slots, release: np.ndarray, length: int, m: int) -> None:
        """Keep the slots' buffers for the next call of the same shape. Only one (cache length, stop width, top-k) is
        kept (one set per slot bucket): KV caches of other lengths are let go rather than held side by side."""
        kt = int(slots.top_ids.shape[2])
        for key in [k for k in self._idle if k[1:] != (length, m, kt)]:
            del self._idle[key]
        self._idle[(int(slots.done.shape[0]), length, m, kt)] = (slots, release)

    def pool(self) -> Any:
        """The prefix cache's pool of blocks, made at first use (prefix_cache.py)."""
        if self._pool is None:
            self._pool = pool_program(self._config, self._dtype, self.prefix_tokens)()
            self.prefix = PrefixIndex(self._pool.k.shape[1]) if self.prefix_tokens >= BLOCK else None
        return self._pool

    def release_idle(self) -> int:
        """Let go of the decode slots kept for the next call (their KV caches); the number of slot sets released."""
        n = len(self._idle)
        self._idle.clear()
        return n

    # -------------------------------------------------------------- compiled calls

    def _admit_call(self, lora, base, slots: Slots, rows: list[SampleRow], adm: Admission | None, chunk: Chunk, *,
                    plp: bool, alt_k: int, compile_only: bool = False, pool: Any = None):  # fmt: skip
        b = int(slots.done.shape[0])
        m = int(slots.params.stop_ids.shape[1])
        r, c = chunk.chunk.shape
        adapter = np.full((r,), -1, np.int32)
        scale = np.zeros((r,), np.float32)
        temp, top_p = np.ones((r,), np.float32), np.ones((r,), np.float32)
        top_k, sample_index, max_tokens = np.full((r,), -1, np.int32), np.zeros((r,), np.int32), np.ones((r,), np.int32)
        seeds = np.zeros((r, 2), np.uint32)
        stop_ids = np.full((r, m), -1, np.int32)
        for i, row_i in enumerate(adm.chosen if adm is not None else []):
            row = rows[row_i]
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
        label = f"slots={b} cache={length} adapters={_stack_size(lora)} stops={m} rows={r} chunk={c}"
        args = (lora, base, slots, self.pool() if pool is None else pool, put(chunk.chunk), put(chunk.nexts),
                put(chunk.start), put(chunk.prompt_len), put(chunk.index), put(chunk.final), params, put(adapter),
                put(scale), put(chunk.cached), put(chunk.read), put(chunk.write), put(chunk.targets))  # fmt: skip
        static = dict(prompt_logprobs=plp, alt_k=alt_k)
        if compile_only:
            self._admit.prepare(label, *args, **static)
            return slots, {}
        slots, self._pool, scores = self._admit(label, *args, **static)
        return slots, scores

    def _decode_call(self, lora, base, slots: Slots, release: np.ndarray, steps: int, target: int, *,
                     compile_only: bool = False) -> Slots:  # fmt: skip
        b, length = (int(x) for x in slots.tokens.shape)
        label = f"slots={b} cache={length} adapters={_stack_size(lora)} stops={int(slots.params.stop_ids.shape[1])}"
        args = (lora, base, slots, self.placement.put_batch(release), jnp.int32(steps), jnp.int32(target))
        if compile_only:
            self._decode.prepare(label, *args)
            return slots
        return self._decode(label, *args)

    def _ensure_family(self, lora, base, length: int, m: int, plp: bool, using: int | None = None) -> None:
        """Compile every slot bucket's decode chunk and admission for this family (the buckets whose KV caches fit
        the memory plan). Only bucket `using` (None: the smallest) gets its slots allocated and kept: the others are
        compiled from shapes, so a family of long caches never holds every bucket's KV caches at once."""
        family = (length, m, plp, _stack_size(lora), tuple(self.buckets(length)))
        if family in self._families:
            return
        self._families.add(family)
        t0 = time.perf_counter()
        before = self.compile_count()
        buckets = self.buckets(length)
        using = buckets[0] if using is None else using
        for b in buckets:
            shapes = b != using
            self.warm_bucket(abstract(lora) if shapes else lora, abstract(base) if shapes else base, b, length, m,
                             plp, from_shapes=shapes)  # fmt: skip
        if self.compile_count() > before:
            log.info("sampler: compiled %d programs for cache=%d stops=%d prompt_logprobs=%s adapters=%d in %.1fs",
                     self.compile_count() - before, length, m, plp, family[3], time.perf_counter() - t0)  # fmt: skip

    def _ensure_bucket(self, lora, base, b: int, length: int, m: int, plp: bool) -> None:
        """Compile one slot bucket of a family, once."""
        key = (b, length, m, plp, _stack_size(lora))
        if key not in self._buckets_built:
            self._buckets_built.add(key)
            self.warm_bucket(lora, base, b, length, m, plp)

    def warm_bucket(self, lora, base, b: int, length: int, m: int, plp: bool, *, from_shapes: bool = False) -> None:
        """One slot bucket of a family: its empty slots (kept for the next call), its admission and decode chunk
        compiled, not run. `from_shapes` (`lora`, `base`: `abstract` of them): nothing allocated or kept, no state a
        call uses read or changed, so safe on another thread beside any call; a call that needs one of these
        programs meanwhile waits for that compile alone (AotCache)."""
        if from_shapes:  # the pool's shapes from its program, compiled (cheap) and not run
            pool = pool_program(self._config, self._dtype, self.prefix_tokens).lower().compile().out_info
            slots = self._empty.prepare(f"slots={b} cache={length} stops={m} topk=0", slots=b, cache_len=length,
                                        stops=m, topk=0).out_info  # fmt: skip
            release = None
        else:
            (slots, release), pool = self._take(b, length, m), self.pool()
        r, c = self.admission_rows(b, length), chunk_len(length)
        blank = admission.blank(r, c, length, b, pool.k.shape[1])
        self._admit_call(lora, base, slots, [], None, blank, plp=plp, alt_k=0, compile_only=True, pool=pool)
        self._decode_call(lora, base, slots, np.zeros((b,), bool), 0, 0, compile_only=True)
        if release is not None:
            self._keep(slots, release, length, m)

    def warm_up(self, lora, base, *, cache_lens, stop_width: int = STOP_IDS,
                prompt_logprobs: tuple[bool, ...] = (False,), buckets: tuple[int, ...] | None = None,
                from_shapes: bool = False) -> None:  # fmt: skip
        """Compile the families of these shapes; only the slot `buckets` named (None: all, and the family counts
        as done, unless `from_shapes`: then nothing is recorded, see `warm_bucket`)."""
        for length in cache_lens:
            for plp in prompt_logprobs:
                if buckets is None and not from_shapes:
                    self._ensure_family(lora, base, length, stop_width, plp)
                    continue
                for b in buckets or self.buckets(length):
                    self.warm_bucket(lora, base, b, length, stop_width, plp, from_shapes=from_shapes)

    # -------------------------------------------------------------- the loop

    def _prefill(self, lora, base, slots: Slots, rows: list[SampleRow], adm: Admission, r: int,
                 results: list[RowOutput | None]) -> Slots:  # fmt: skip
        """Every chunk of one admission, in order; rows that score their prompt gather their scores chunk by chunk."""
        b, length = (int(x) for x in slots.tokens.shape)
        scoring = {j: PromptScores(rows[i], adm.starts[j]) for j, i in enumerate(adm.chosen) if rows[i].scores_prompt}
        c = chunk_len(length)
        for chunk in adm.chunks(rows, r, c, length, b, self.pool().k.shape[1]):
            slots, scores = self._admit_call(lora, base, slots, rows, adm, chunk, plp=adm.prompt_logprobs,
                                             alt_k=adm.alt_k)  # fmt: skip
            host = self.placement.to_host(scores) if scores else {}
            for j, acc in scoring.items():
                if chunk.index[j] < b:
                    acc.add(j, int(chunk.start[j]), host)
        for j, acc in scoring.items():
            results[adm.chosen[j]] = acc.result()
        return slots

    def run(self, rows: list[SampleRow], lora: Any, base: Any) -> list[RowOutput]:
        n = len(rows)
        length, m, kt = self.cache_len(rows), self.stop_width(rows), self.topk_width(rows)
        if self.memory is None or self.memory.kv_slots(warmed_bucket(length, self.warmed_caches)) >= n:
            length = warmed_bucket(length, self.warmed_caches)
        buckets = self.buckets(length)
        b = next((x for x in buckets if x >= n), buckets[-1])
        small = self.admission_rows(b, length)
        slots, release = self._take(b, length, m, kt)
        self.pool()
        queue = deque(range(n))
        free = deque(range(b))
        occupant: dict[int, int] = {}  # slot -> row
        results: list[RowOutput | None] = [None] * n
        checked: dict[int, int] = {}  # row -> tokens already checked for stop strings
        hits: dict[int, int] = {}  # row -> prompt tokens it took from the prefix cache
        # (An exception leaves the slots out of the idle pool: their buffers may have been donated.)
        while queue or occupant:
            while queue and free:
                chosen = admission.choose(rows, queue, min(len(free), small), self.prefix is not None)
                adm = admission.plan(rows, chosen, [free.popleft() for _ in chosen], self.prefix)
                plain = not (kt or adm.alt_k or adm.target_width)  # the family warm-up builds
                if self.eager_buckets and plain:
                    plp = adm.prompt_logprobs
                    self._keep(slots, release, length, m)
                    if (length, m, plp, _stack_size(lora)) in self.scheduled_families or length > EAGER_CACHE_LEN:
                        self._ensure_bucket(lora, base, b, length, m, plp)
                    else:
                        self._ensure_family(lora, base, length, m, plp, using=b)
                    slots, release = self._take(b, length, m, kt)
                slots = self._prefill(lora, base, slots, rows, adm, small, results)
                for i, s, start in zip(adm.chosen, adm.slots, adm.starts):
                    occupant[s] = i
                    release[s] = False
                    hits[i] = start
            strings = any(rows[i].stop_strings for i in occupant.values())
            steps = STOP_STRING_CHUNK if strings else length
            target = b if not queue else min(b, b - len(occupant) + min(len(queue), small))
            slots = self._decode_call(lora, base, slots, release, steps, target)
            release = np.zeros((b,), bool)
            done, n_gen, hit, tokens, logprobs = self.placement.to_host(
                (slots.done, slots.n_gen, slots.hit_stop_id, slots.tokens, slots.logprobs))  # fmt: skip
            top = self.placement.to_host((slots.top_ids, slots.top_lp)) if kt else None
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
                out = results[i] or RowOutput([], [], reason)
                kk = row.topk_sample_logprobs
                results[i] = dataclasses.replace(
                    out, tokens=tokens[s, :k].tolist(), logprobs=logprobs[s, :k].tolist(), stop_reason=reason,
                    cache_hit_tokens=hits[i],
                    topk_sample_logprobs=(top[0][s, :k, :kk].copy(), top[1][s, :k, :kk].copy()) if top and kk else None,
                )  # fmt: skip
                del occupant[s]
                free.append(s)
        self._keep(slots, release, length, m)
        return results  # type: ignore[return-value]


def _stack_size(lora: Any) -> int:
    return int(jax.tree.leaves(lora)[0].shape[0])
