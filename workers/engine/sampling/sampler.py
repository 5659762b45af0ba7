"""Continuous-batching sampler, host side: a fixed set of decode slots, rows admitted into free slots, KV-cache
decoding.

Every sample of every request is one *row*. A `sample` call queues its rows; `SlotSampler.run` admits them into a
slot bucket's decode slots (8, 64 or 256 rows, each bucket with its own cache length: buckets.py), prefills the newly
admitted rows' prompts in chunks of one length straight into their slots' part of the one shared KV cache, and runs
jitted decode chunks over all slots at once. A row that finishes frees its slot; waiting rows are admitted at the
next chunk boundary. Rows of different snapshots share decode steps: each slot carries its adapter index into a
small stack of snapshot LoRAs, its own position, sampling parameters, PRNG stream and stop ids. The device programs
(slot state, sampling maths, the jitted admit and decode steps) are in `decode.py`, called through their AOT caches
in `sampler_programs.py`; this module schedules rows onto them.

The program set is bounded by design: a program's shapes follow from its slot bucket, never from a prompt's length,
where it starts in the prefix cache, its stop list, top-k or scores. A *family* is (adapter-stack size, scoring);
per slot bucket it has one admission (a chunk of the bucket's rows and tokens) and, shared by both scoring variants,
one decode chunk; every bucket has one program making its empty slots. docs/architecture.md §The bounded program
set counts them. With `eager_buckets` the first use of a family compiles every slot bucket's programs (the others
from shapes alone), so coordinator batches of varying size (4 rows, then 252, ...) never compile in the middle of a
workload; `warm_up` does the same ahead of time, or from shapes alone beside the traffic. A family the JAX worker's
background warm-up is about to build (`scheduled_families`) is the exception: a request compiles its own slot
bucket only.

Stop token ids are checked on device; stop strings here, on the host, between chunks (only when some row has them).
Which rows go into one admission, where their prompts start in the prefix cache and the arrays of each chunk are
`admission.py`'s; the records of rows and their outputs are `rows.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any, Literal

import numpy as np
from flax import nnx

from tinkerflow.common.settings import env_setting

from ..model.families import ModelConfig
from ..model.sharding import DeviceLayout
from ..model.slot_cache import recurrent
from ..runtime.aot_cache import AotCache, abstract
from ..runtime.memory_plan import MemoryPlan
from . import admission
from .admission import Admission
from .buckets import DEFAULT_SAMPLE_SLOTS, SlotBucket, pick_bucket, slot_buckets
from .decode import Slots, pool_program
from .prefix_cache import BLOCK, PrefixIndex, state_slots
from .rows import PromptScores, RowOutput, SampleRow, first_stop_string_end
from .sampler_programs import SamplerPrograms, stack_size

log = logging.getLogger(__name__)

# Decode steps between host checks of stop strings (only when some row has stop strings).
STOP_STRING_CHUNK = 16
# (stack size, scoring): the programs an admission and its decode chunk are, per slot bucket.
Family = tuple[int, bool]


class SlotSampler:
    """Host driver of the decode slots (see the module docstring). One thread at a time, like the engine."""

    def __init__(
        self, graphdef: nnx.GraphDef, placement: DeviceLayout, config: ModelConfig, dtype: Any, tokenizer: Any
    ):
        # A model with recurrent layers (its slots hold their states beside the keys and values) resumes prefix
        # cache hits from state snapshots the pool keeps beside its blocks (prefix_cache.py).
        self.recurrent = recurrent(config)
        self.placement = placement
        self.config = config
        self.tokenizer = tokenizer
        self.max_slots = DEFAULT_SAMPLE_SLOTS
        # Compile every slot bucket of a family at its first use (see module docstring).
        # (TINKERFLOW_SAMPLER_EAGER_BUCKETS=0, an env-only Settings field, compiles each bucket when first needed.)
        self.eager_buckets = bool(env_setting("sampler_eager_buckets"))
        self.programs = SamplerPrograms(graphdef, placement, config, dtype)
        # The slots of the last call, kept for the next one of its bucket (one set: the buckets hold about the same
        # KV tokens each, and two would hold twice that).
        self._idle: tuple[SlotBucket, Slots, np.ndarray] | None = None
        self._families: set[tuple[Family, tuple[SlotBucket, ...]]] = set()
        # Families a background warm-up builds at every bucket soon: a request compiles its own bucket only.
        self.scheduled_families: frozenset[Family] = frozenset()
        self._buckets_built: set[tuple[SlotBucket, Family]] = set()
        # The device-memory plan (Engine sets it): slot buckets and prefill rows are sized to fit it.
        self.memory: MemoryPlan | None = None
        # The prefix cache (prefix_cache.py): `prefix_tokens` of pool, made at first use (0: no cache, and a pool
        # of one block nothing is ever written to).
        self.prefix_tokens = 0
        self.prefix: PrefixIndex | None = None
        self._pool: Any = None
        self._config, self._dtype = config, dtype

    def caches(self) -> list[AotCache]:
        return self.programs.caches()

    def compile_count(self) -> int:
        """Programs the sampler built so far, recompiles included: only grows, so a difference counts compiles."""
        return sum(c.compiles for c in self.caches())

    def buckets(self) -> list[SlotBucket]:
        """The slot buckets (buckets.py), fewest slots first: their KV caches and prefill rows sized to the memory
        plan."""
        memory = self.memory
        return slot_buckets(
            self.max_slots,
            self.config.max_position_embeddings,
            self.placement,
            kv_tokens=None if memory is None else memory.kv_tokens(self.max_slots),
            prefill_rows=None if memory is None else memory.prefill_rows,
        )

    def max_cache_len(self) -> int:
        """The most positions (prompt + max_tokens) one row can be sampled with."""
        return max(b.cache_len for b in self.buckets())

    def _take(self, bucket: SlotBucket) -> tuple[Slots, np.ndarray]:
        idle, self._idle = self._idle, None
        if idle is not None and idle[0] == bucket:
            return idle[1], idle[2]
        del idle  # another bucket's KV caches go before this one's are made
        slots = self.programs.empty(bucket.label, slots=bucket.slots, cache_len=bucket.cache_len)
        return slots, np.zeros((bucket.slots,), bool)

    def _keep(self, bucket: SlotBucket, slots: Slots, release: np.ndarray) -> None:
        self._idle = (bucket, slots, release)

    def pool(self) -> Any:
        """The prefix cache's pool of blocks, made at first use (prefix_cache.py)."""
        if self._pool is None:
            self._pool = pool_program(self._config, self._dtype, self.prefix_tokens)()
            blocks = self._pool.k.shape[1]
            caching = self.prefix_tokens >= BLOCK
            self.prefix = PrefixIndex(blocks, state_slots(blocks) if self.recurrent else 0) if caching else None
        return self._pool

    def release_idle(self) -> int:
        """Let go of the decode slots kept for the next call (their KV caches); the number of slot sets released."""
        n, self._idle = int(self._idle is not None), None
        return n

    # -------------------------------------------------------------- compiles

    def _ensure_family(self, lora, base, scoring: bool, using: SlotBucket) -> None:
        """Compile every slot bucket's admission and decode chunk of this family; only bucket `using` gets its
        slots allocated and kept, the others are compiled from shapes (their KV caches never held at once)."""
        buckets = tuple(self.buckets())
        family = ((stack_size(lora), scoring), buckets)
        if family in self._families:
            return
        self._families.add(family)
        t0, before = time.perf_counter(), self.compile_count()
        for b in buckets:
            shapes = b != using
            self.warm_bucket(
                abstract(lora) if shapes else lora, abstract(base) if shapes else base, b, scoring, from_shapes=shapes
            )
        if self.compile_count() > before:
            log.info(
                "sampler: compiled %d programs for adapters=%d scoring=%s in %.1fs",
                self.compile_count() - before,
                stack_size(lora),
                scoring,
                time.perf_counter() - t0,
            )

    def _ensure_bucket(self, lora, base, bucket: SlotBucket, scoring: bool) -> None:
        """Compile one slot bucket of a family, once."""
        key = (bucket, (stack_size(lora), scoring))
        if key not in self._buckets_built:
            self._buckets_built.add(key)
            self.warm_bucket(lora, base, bucket, scoring)

    def warm_bucket(self, lora, base, bucket: SlotBucket, scoring: bool, *, from_shapes: bool = False) -> None:
        """One slot bucket of a family: its empty slots (kept for the next call), its admission and decode chunk
        compiled, not run. `from_shapes` (`lora`, `base`: `abstract` of them): nothing allocated or kept, no state a
        call uses read or changed, so safe on another thread beside any call; a call that needs one of these
        programs meanwhile waits for that compile alone (AotCache)."""
        if from_shapes:  # the pool's shapes from its program, compiled (cheap) and not run
            pool = pool_program(self._config, self._dtype, self.prefix_tokens).lower().compile().out_info
            slots = self.programs.empty.prepare(bucket.label, slots=bucket.slots, cache_len=bucket.cache_len).out_info
            release = None
        else:
            (slots, release), pool = self._take(bucket), self.pool()
        blank = admission.blank(bucket.rows, bucket.chunk, bucket.cache_len, bucket.slots, pool.k.shape[1], scoring)
        self.programs.admit_call(lora, base, bucket, slots, pool, [], None, blank, compile_only=True)
        self.programs.decode_call(lora, base, bucket, slots, np.zeros((bucket.slots,), bool), 0, 0, compile_only=True)
        if release is not None:
            self._keep(bucket, slots, release)

    def warm_up(
        self,
        lora,
        base,
        *,
        scoring: tuple[bool, ...] = (False,),
        buckets: tuple[int, ...] | None = None,
        from_shapes: bool = False,
    ) -> None:
        """Compile the families of this stack (`lora`) and these scoring variants; only the slot `buckets` named
        (None: all, and the family counts as done, unless `from_shapes`: then nothing is recorded, see
        `warm_bucket`)."""
        every = self.buckets()
        self.programs.warm_tower(lora, base)
        for sc in scoring:
            if buckets is None and not from_shapes:
                self._ensure_family(lora, base, sc, every[0])
                continue
            for b in every:
                if buckets is None or b.slots in buckets:
                    self.warm_bucket(lora, base, b, sc, from_shapes=from_shapes)

    # -------------------------------------------------------------- the loop

    def _prefill(
        self,
        lora,
        base,
        bucket: SlotBucket,
        slots: Slots,
        rows: list[SampleRow],
        adm: Admission,
        results: list[RowOutput | None],
        seen: dict,
    ) -> Slots:
        """Every chunk of one admission, in order; rows that score their prompt gather their scores chunk by chunk.
        `seen`: the tower's features of this call's images so far, by digest (prompt_images.row_images)."""
        scoring = {j: PromptScores(rows[i], adm.starts[j]) for j, i in enumerate(adm.chosen) if rows[i].scores_prompt}
        b, c = bucket.slots, bucket.chunk
        # Each row's images through the tower, unless the prefix cache holds all their placeholders.
        images = [self.programs.row_images(lora, base, rows[i], s, seen) for i, s in zip(adm.chosen, adm.starts)]
        for chunk in adm.chunks(rows, bucket.rows, c, bucket.cache_len, b, self.pool().k.shape[1]):
            slots, self._pool, scores = self.programs.admit_call(
                lora, base, bucket, slots, self.pool(), rows, adm, chunk, images
            )
            host = self.placement.to_host(scores) if scores else {}
            for j, acc in scoring.items():
                if chunk.index[j] < b:
                    acc.add(j, int(chunk.start[j]), host)
        for j, acc in scoring.items():
            results[adm.chosen[j]] = acc.result()
        return slots

    def _compile_for(self, lora, base, bucket: SlotBucket, scoring: bool) -> None:
        """What a call about to run `bucket` compiles first (module docstring: eager buckets)."""
        if (stack_size(lora), scoring) in self.scheduled_families:
            self._ensure_bucket(lora, base, bucket, scoring)
        else:
            self._ensure_family(lora, base, scoring, bucket)

    def run(self, rows: list[SampleRow], lora: Any, base: Any) -> list[RowOutput]:
        n = len(rows)
        bucket = pick_bucket(self.buckets(), n, max(len(r.prompt) + r.max_tokens for r in rows))
        b, length, small = bucket.slots, bucket.cache_len, bucket.rows
        top_k = any(r.topk_sample_logprobs for r in rows)
        slots, release = self._take(bucket)
        self.pool()
        queue = deque(range(n))
        free = deque(range(b))
        occupant: dict[int, int] = {}  # slot -> row
        results: list[RowOutput | None] = [None] * n
        seen: dict = {}  # the tower's features by image digest: rows of this call sharing an image run it once
        checked: dict[int, int] = {}  # row -> tokens already checked for stop strings
        hits: dict[int, int] = {}  # row -> prompt tokens it took from the prefix cache
        # (An exception leaves the slots out of the idle pool: their buffers may have been donated.)
        while queue or occupant:
            while queue and free:
                chosen = admission.choose(rows, queue, min(len(free), small), self.prefix is not None)
                adm = admission.plan(rows, chosen, [free.popleft() for _ in chosen], self.prefix)
                if self.eager_buckets:
                    self._keep(bucket, slots, release)
                    self._compile_for(lora, base, bucket, adm.scoring)
                    slots, release = self._take(bucket)
                slots = self._prefill(lora, base, bucket, slots, rows, adm, results, seen)
                for i, s, start in zip(adm.chosen, adm.slots, adm.starts):
                    occupant[s] = i
                    release[s] = False
                    hits[i] = start
            strings = any(rows[i].stop_strings for i in occupant.values())
            steps = STOP_STRING_CHUNK if strings else length
            target = b if not queue else min(b, b - len(occupant) + min(len(queue), small))
            slots = self.programs.decode_call(lora, base, bucket, slots, release, steps, target)
            release = np.zeros((b,), bool)
            done, n_gen, hit, tokens, logprobs = self.placement.to_host(
                (slots.done, slots.n_gen, slots.hit_stop_id, slots.tokens, slots.logprobs)
            )
            top = self.placement.to_host((slots.top_ids, slots.top_lp)) if top_k else None
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
                    out,
                    tokens=tokens[s, :k].tolist(),
                    logprobs=logprobs[s, :k].tolist(),
                    stop_reason=reason,
                    cache_hit_tokens=hits[i],
                    topk_sample_logprobs=(top[0][s, :k, :kk].copy(), top[1][s, :k, :kk].copy()) if top and kk else None,
                )
                del occupant[s]
                free.append(s)
        self._keep(bucket, slots, release)
        return results  # type: ignore[return-value]
