"""Sampling at scale costs Temporal O(batches), not O(calls): concurrent SDK sample calls on one sampler, coalesced
into a few SampleRequest workflows, fetch each workflow's result once however many futures poll it (counted on the
API's /metrics), and every call still gets its own answer. The unit half is tests/api/test_batch_results.py."""

from __future__ import annotations

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

pytestmark = pytest.mark.e2e

CALLS = 32


def api_counters(stack) -> dict[str, float]:
    text = httpx.get(f"{stack.base_url}/metrics", headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=30)
    assert text.status_code == 200
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text.text)
        for s in family.samples
        if s.name in ("tinkerflow_api_sample_batches_total", "tinkerflow_api_batch_result_fetches_total")
    }


def test_concurrent_sample_calls_fetch_each_batch_result_once_and_each_gets_its_own_answer(stack, base_model):
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    sampler = client.create_sampling_client(base_model=base_model).result(timeout=300)
    sampler.sample(  # the first call of a fresh sampler: out of the count, so the burst below finds it warm
        types.ModelInput.from_ints([1, 2, 3]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=1)
    ).result(timeout=600)
    before = api_counters(stack)

    # Call i asks for its own (num_samples, max_tokens) pair, so each answer shows which call it belongs to.
    shapes = [(1 + i // 8, 1 + i % 8) for i in range(CALLS)]
    futures = [
        sampler.sample(
            types.ModelInput.from_ints([3 + i, 7, 11 + i]),
            num_samples=n,
            sampling_params=types.SamplingParams(max_tokens=m, temperature=1.0, stop=[]),
        )
        for i, (n, m) in enumerate(shapes)
    ]
    answers = [f.result(timeout=600) for f in futures]
    after = api_counters(stack)

    for (n, m), answer in zip(shapes, answers, strict=True):
        assert [len(s.tokens) for s in answer.sequences] == [m] * n
    batches = after["tinkerflow_api_sample_batches_total"] - before["tinkerflow_api_sample_batches_total"]
    fetches = after["tinkerflow_api_batch_result_fetches_total"] - before["tinkerflow_api_batch_result_fetches_total"]
    assert 1 <= batches < CALLS, f"{CALLS} concurrent calls formed {batches} batches: nothing was coalesced"
    # each batch's result is fetched at most once (a batch slower than the long poll, 25 s, would re-fetch once
    # per re-poll: not on this workload), and every future was answered through one of them
    assert 1 <= fetches <= batches, f"{fetches} result fetches for {batches} batches of {CALLS} calls"
