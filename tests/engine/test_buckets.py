"""The sampler's and trainer's shape buckets: a fixed, small set per model, whatever the requests (sampling/buckets.py,
shape_buckets.py train_seq_len)."""

from __future__ import annotations

from typing import Any

import pytest

from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.families.qwen3 import tiny as tiny_model
from tinkerflow.workers.engine.model.sharding import DeviceLayout, MeshConfig, as_mesh
from tinkerflow.workers.engine.sampling.buckets import MIN_CACHE_LEN, SlotBucket, chunk_len, pick_bucket, slot_buckets
from tinkerflow.workers.engine.shape_buckets import round_up_pow4, train_seq_len


@pytest.fixture(scope="module")
def placement() -> DeviceLayout:
    return DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), ModelConfig.from_hf(tiny_model.config_dict(eos_token_id=1)))


def _pairs(buckets: list[SlotBucket]) -> list[tuple[int, int]]:
    return [(b.slots, b.cache_len) for b in buckets]


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        (256, [(8, 256), (64, 256), (256, 256)]),
        (2048, [(8, 2048), (64, 2048), (256, 2048)]),
        (16384, [(8, 16384), (64, 8192), (256, 2048)]),
        (40960, [(8, 40960), (64, 8192), (256, 2048)]),
        (131072, [(1, 131072), (8, 65536), (64, 8192), (256, 2048)]),
    ],
)
def test_every_context_has_a_few_buckets_each_holding_the_same_kv_tokens(placement, context, expected):
    buckets = slot_buckets(256, context, placement)
    assert _pairs(buckets) == expected
    for b in buckets:
        assert b.cache_len % b.chunk == 0 and b.chunk == chunk_len(b.cache_len)
        assert b.rows == max(1, b.slots // 8)
        assert b.slots * b.cache_len <= max(256 * 2048, b.cache_len)


def test_a_small_memory_plan_drops_the_buckets_whose_share_is_too_short(placement):
    # 2,048 KV tokens: 8 slots of 256; 64 slots would get 32 positions, less than the shortest cache.
    assert _pairs(slot_buckets(256, 2048, placement, kv_tokens=2048)) == [(1, 2048), (8, 256)]
    assert _pairs(slot_buckets(256, 256, placement, kv_tokens=2048)) == [(8, 256)]
    assert _pairs(slot_buckets(256, 2048, placement, kv_tokens=MIN_CACHE_LEN)) == [(1, MIN_CACHE_LEN)]


def test_prefill_rows_follow_the_memory_plan(placement):
    [small, mid, large] = slot_buckets(256, 2048, placement, prefill_rows=lambda chunk, slots, cache: 5)
    assert (small.rows, mid.rows, large.rows) == (1, 4, 4)


def test_a_batch_takes_the_smallest_bucket_that_holds_it(placement):
    buckets = slot_buckets(256, 16384, placement)
    assert pick_bucket(buckets, 1, 100).slots == 8
    assert pick_bucket(buckets, 9, 100).slots == 64
    assert pick_bucket(buckets, 100, 2000).slots == 256
    assert pick_bucket(buckets, 100, 3000).slots == 64  # 256 slots' caches are too short: rows wait for slots
    assert pick_bucket(buckets, 2, 12000).slots == 8


def test_training_rows_have_three_lengths_up_to_4096_tokens():
    assert {train_seq_len(n) for n in range(1, 4097)} == {256, 1024, 4096}
    assert [train_seq_len(n) for n in (1, 256, 257, 1024, 1025, 4096)] == [256, 256, 1024, 1024, 4096, 4096]
    assert train_seq_len(5000) == 6144  # past 4,096: two significant bits, the memory plan's limits
    assert train_seq_len(3000, limit=3072) == 3072  # a 4x bucket past the limit: the tighter one
    assert [round_up_pow4(n) for n in (1, 2, 4, 5, 16, 17)] == [1, 4, 4, 16, 16, 64]
    assert round_up_pow4(5, cap=8) == 8


def test_recurrent_states_per_slot_come_out_of_the_kv_budget():
    from tinkerflow.workers.engine.runtime.memory_plan import SLOT_BUFFER_BYTES_PER_TOKEN, TRAIN_SHARE, MemoryPlan

    per_token = 1000 + SLOT_BUFFER_BYTES_PER_TOKEN
    fields: dict[str, Any] = dict(
        device="test",
        capacity_bytes=0,
        resident_bytes=0,
        snapshot_bytes=0,
        reserve_bytes=0,
        prefix_cache_bytes=0,
        work_bytes=int(per_token * 10_000 / TRAIN_SHARE) + 1,
        train_bytes_per_token=1,
        train_bytes_per_token_no_remat=1,
        train_bytes_per_token_dots=1,
        train_fixed_bytes=0,
        kv_bytes_per_token=1000,
        prefill_bytes_per_token=0,
        max_train_tokens=1,
        remat_min_tokens=1,
        full_remat_min_tokens=1,
        max_sample_tokens=1,
        max_lora_rank=1,
    )
    plain = MemoryPlan(**fields)
    hybrid = MemoryPlan(**fields, state_bytes_per_slot=per_token * 100)  # a slot's state: 100 tokens' worth
    assert plain.kv_tokens(64) == plain.kv_slots(1) == 10_000
    assert hybrid.kv_tokens(64) == 10_000 - 64 * 100
    assert hybrid.kv_slots(100) == 10_000 // 200
    assert hybrid.prefill_rows(1, 10, 0) < plain.prefill_rows(1, 10, 0)
