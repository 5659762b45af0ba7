"""Sampling requests in, results out: the engine's `sample` between `SampleInput`s and the sampler's rows.

Each request is validated on its own (a bad one, or one naming an evicted snapshot, yields an InputError in its
place); every sample of every valid request becomes one `SampleRow` routed to its snapshot's index in this batch's
LoRA stack (-1: the base model); `SlotSampler.run` decodes them all together, and its row outputs are gathered back
per request in the SDK's shapes (prompt logprobs with the first position padded). `warm_up` compiles the sampler's
programs for given shape buckets ahead of traffic.

The stop rule (docs/wire-contract.md §Sampling): no stop list stops at the model's EOS, an empty one never stops, and
a non-empty one (strings or token ids) stops at any of its entries or at EOS, whichever comes first.

Prefix-cache namespaces: a request's prompt blocks are shared with the requests of its sampling session
(`cache_namespace`) on the same weights: the snapshot key and its version (an inflight target is re-taken under the
same key), so a block is never read under other weights, by another session or by another tenant.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from typing import Any

import numpy as np

from ..runtime.memory_plan import MemoryPlan
from ..training.datum_checks import checked_images
from ..types import TOPK_PAD_LOGPROB, InputError, ModelInfo, SampledSequence, SampleInput, SampleResult
from .buckets import STACK_SIZES, STOP_IDS
from .rows import SampleRow, image_spans, seed_words
from .sample_checks import check_sample
from .sampler import SlotSampler
from .snapshots import SamplerSnapshots, evicted_message

log = logging.getLogger(__name__)
# A request that passed its checks: its index, its prompt, and the stop ids of its rows (sample's checks computed them).
Valid = tuple[int, np.ndarray, list[int]]


def sample(
    sampler: SlotSampler,
    snapshots: SamplerSnapshots,
    base: Any,
    requests: list[SampleInput],
    *,
    info: ModelInfo,
    memory: MemoryPlan | None = None,
) -> list[SampleResult | InputError]:
    results: list[SampleResult | InputError | None] = [None] * len(requests)
    max_len = info.max_position_embeddings
    # The most positions a row may need: what the memory plan fits, and the longest slot bucket's cache (once a call).
    room = None if memory is None else min(memory.max_sample_tokens, sampler.max_cache_len())
    valid: list[Valid] = []
    for r, req in enumerate(requests):
        try:
            if req.target_prompt_logprobs is not None:  # int64 off the wire; -1 and ids within the vocabulary
                req.target_prompt_logprobs = np.asarray(req.target_prompt_logprobs)
            if req.snapshot is not None and snapshots.evicted(req.snapshot):
                raise InputError(evicted_message(req.snapshot, snapshots.cache.budget_bytes))
            prompt = check_sample(req, vocab=info.vocab_size, max_len=max_len, snapshots=snapshots.keys())
            req.images = checked_images("images", tuple(req.images), prompt, info.image_token_id)
            need = len(prompt) + min(req.max_tokens, max_len - len(prompt))
            if memory is not None and room is not None and need > room:
                raise InputError(memory.sample_limit_message(need))
            if len(stops := stop_ids(req, info.eos_token_ids)) > STOP_IDS:
                raise InputError(
                    f"stop_token_ids has {len(stops)} distinct ids with the model's end-of-sequence ones; at most "
                    f"{STOP_IDS} are allowed"
                )
        except InputError as e:
            results[r] = e
            continue
        valid.append((r, prompt, stops))
    # One decode batch routes its rows into at most STACK_SIZES[-1] snapshots: a call naming more runs in several.
    groups: list[list[Valid]] = []
    keys: list[set[str]] = []
    for entry in valid:
        key = requests[entry[0]].snapshot
        fits = next((g for g, k in enumerate(keys) if key is None or key in k or len(k) < STACK_SIZES[-1]), None)
        if fits is None:
            groups.append([])
            keys.append(set())
            fits = len(groups) - 1
        groups[fits].append(entry)
        if key is not None:
            keys[fits].add(key)
    for group in groups:
        results_of = _sample_group(sampler, snapshots, base, requests, group, info)
        for r, res in results_of.items():
            results[r] = res
    return results  # type: ignore[return-value]


def _sample_group(
    sampler: SlotSampler,
    snapshots: SamplerSnapshots,
    base: Any,
    requests: list[SampleInput],
    valid: list[Valid],
    info: ModelInfo,
) -> dict[int, SampleResult]:
    """One decode batch: every sample of every request in `valid` (their snapshots fit one stack) as rows."""
    max_len = info.max_position_embeddings
    keys = tuple(dict.fromkeys(key for r, *_ in valid if (key := requests[r].snapshot) is not None))
    stack_index = {k: i for i, k in enumerate(keys)}
    rows: list[SampleRow] = []
    owner: list[int] = []
    for r, p, stops in valid:
        req = requests[r]
        seed = seed_words(int(req.seed if req.seed is not None else secrets.randbits(64)))
        adapter, scale = -1, 0.0  # the base model
        if req.snapshot is not None:
            adapter, scale = stack_index[req.snapshot], snapshots[req.snapshot].scale
        namespace = None
        if req.cache_namespace is not None:
            namespace = (req.cache_namespace, req.snapshot, snapshots.version(req.snapshot) if req.snapshot else 0)
        targets = req.target_prompt_logprobs
        spans = image_spans(p, req.images, info.image_token_id) if req.images and info.image_token_id else ()
        for j in range(req.num_samples):
            scoring = (bool(req.include_prompt_logprobs) or req.topk_prompt_logprobs > 0) and j == 0
            rows.append(
                SampleRow(
                    prompt=p,
                    max_tokens=min(req.max_tokens, max_len - len(p)),
                    temperature=float(req.temperature),
                    top_k=int(req.top_k),
                    top_p=float(req.top_p),
                    seed=seed,
                    sample_index=j,
                    stop_ids=stops,
                    adapter=adapter,
                    scale=scale,
                    prompt_logprobs=scoring,
                    topk_prompt_logprobs=int(req.topk_prompt_logprobs) if j == 0 else 0,
                    stop_strings=list(req.stop_strings),
                    topk_sample_logprobs=int(req.topk_sample_logprobs),
                    target_ids=targets.astype(np.int32) if targets is not None and j == 0 else None,
                    prompt_alt_tokens_k=int(req.prompt_alt_tokens_k) if j == 0 else 0,
                    cache_namespace=namespace,
                    images=req.images,
                    image_spans=spans,
                    needs_from=_needs_from(req, len(p)) if j == 0 else len(p) - 1,
                )
            )
            owner.append(r)

    t0 = time.perf_counter()
    outputs = sampler.run(rows, snapshots.lora_stack(keys), base)
    log.debug("sample: %d rows in %.3fs", len(rows), time.perf_counter() - t0)
    answers = {r: SampleResult(sequences=[]) for r, *_ in valid}
    for r, out in zip(owner, outputs):
        res, req = answers[r], requests[r]
        res.sequences.append(
            SampledSequence(
                tokens=out.tokens,
                logprobs=out.logprobs,
                stop_reason=out.stop_reason,
                topk_logprobs=out.topk_sample_logprobs,
            )
        )
        if len(res.sequences) > 1:
            continue
        res.prompt_cache_hit_tokens = out.cache_hit_tokens  # the prompt's, counted once (row 0)
        # prompt_logprobs_last_n: entries before the last N are None, whatever the cache left computed.
        first = len(req.prompt) - req.prompt_logprobs_last_n if req.prompt_logprobs_last_n else 1
        if out.prompt_logprobs is not None and req.include_prompt_logprobs:
            scored = out.prompt_logprobs[first - 1 :]
            res.prompt_logprobs = [None] * first + [None if math.isnan(v) else v for v in scored]
        if out.topk_prompt_logprobs is not None:
            ids, lps = _pad_first_position(*out.topk_prompt_logprobs)
            ids[:first], lps[:first] = 0, TOPK_PAD_LOGPROB
            res.topk_prompt_logprobs = (ids, lps)
        res.target_prompt_logprobs = out.target_logprobs
        res.prompt_alt_tokens = out.prompt_alt_tokens
    return answers


def stop_ids(req: SampleInput, eos: tuple[int, ...]) -> list[int]:
    """The token ids that end a row (module docstring: the stop rule); stop strings are checked apart."""
    if req.stop_token_ids is None:
        return list(eos)
    if not req.stop_token_ids and not req.stop_strings:
        return []
    return list(dict.fromkeys([*req.stop_token_ids, *eos]))


def _needs_from(req: SampleInput, p: int) -> int:
    """The first prompt position whose hidden state the request's first row needs (the rest may come from the
    prefix cache): the last token's, or where its prompt scoring starts."""
    if req.prompt_alt_tokens_k:
        return 0
    first = p - 1
    if req.include_prompt_logprobs or req.topk_prompt_logprobs:
        first = p - 1 - req.prompt_logprobs_last_n if req.prompt_logprobs_last_n else 0
    if req.target_prompt_logprobs is not None:
        named = np.flatnonzero((np.asarray(req.target_prompt_logprobs) >= 0).any(axis=1))
        first = min(first, int(named[0]) if named.size else first)
    return max(0, first)


def _pad_first_position(ids: np.ndarray, lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows for prompt positions 1..P-1 -> P rows, row 0 the SDK's padding (nothing predicts token 0)."""
    k = ids.shape[1]
    return (
        np.concatenate([np.zeros((1, k), np.int32), ids.astype(np.int32)]),
        np.concatenate([np.full((1, k), TOPK_PAD_LOGPROB, np.float32), lps.astype(np.float32)]),
    )
