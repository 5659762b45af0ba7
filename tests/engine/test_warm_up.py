"""The JAX worker compiles ahead of traffic: after `start_engine` (what `jax_worker.serve` runs before it
registers) and the warm-up, a steady workload that mixes training, forward, optimizer steps, snapshots and sampling
at several concurrency levels, prompt lengths and stop lists, with prompts that hit the prefix cache, builds no
program at all. Counted with JAX's own
compile events (`persistent_cache.counts().requests`: every executable a process builds, eager ops included)."""

from __future__ import annotations

import dataclasses

import numpy as np
from conftest import MAX_ADAPTERS, MAX_RANK

from tinkerflow.common.settings import Settings
from tinkerflow.workers import jax_worker
from tinkerflow.workers.engine.runtime import persistent_cache
from tinkerflow.workers.engine.types import (
    COMPILE_ONLY_KINDS,
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardResult,
    LoraConfig,
    SampleInput,
    SampleResult,
    WarmUpPiece,
)
from tinkerflow.workers.engine.warm_up import first_sample_piece, split_by_slot_bucket


# Small shapes, so the test compiles little: train buckets (1, 4) x 256 tokens, one sampler family (one snapshot,
# no scoring).
def _settings() -> Settings:
    return Settings(
        max_lora_adapters=MAX_ADAPTERS,
        max_lora_rank=MAX_RANK,
        warm_up="ready",
        warm_up_train_rows=(1, 4),
        warm_up_train_lens=(32,),
        warm_up_sampler_stacks=(1,),
        warm_up_scoring=False,
    )


def _datum(n: int, loss: str, rng: np.random.Generator) -> Datum:
    tokens = rng.integers(1, 200, n).astype(np.int32)
    targets = rng.integers(1, 200, n).astype(np.int32)
    if loss == "cross_entropy":
        return Datum(tokens=tokens, inputs={"target_tokens": targets, "weights": np.ones(n, np.float32)})
    return Datum(
        tokens=tokens,
        inputs={
            "target_tokens": targets,
            "logprobs": np.full(n, -2.0, np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        },
    )


def test_after_warm_up_a_steady_mixed_workload_compiles_nothing(qwen3_dir):
    settings = _settings()
    assert jax_worker.warm_up_pieces(settings)[1] == ()  # `ready`: everything before the worker registers
    # As `background` runs it: loaded, the adapter lifecycle before registering (its train buckets compiled on two
    # threads), then piece by piece, each sampler family one slot bucket at a time
    settings = dataclasses.replace(settings, warm_up="background")
    engine = jax_worker.start_engine(settings, str(qwen3_dir), pieces=())
    first, later = jax_worker.warm_up_pieces(settings)
    pieces = split_by_slot_bucket(later, engine.slot_buckets)
    assert sum(p.kind == "sampler" for p in pieces) == len(engine.slot_buckets)  # one family, every prompt length
    built = engine.warm_up(first, 2)
    # (train buckets and sampler families as the background builds them: from the state's shapes, beside the
    # traffic, so the programs traffic runs must be exactly the ones built from shapes)
    built += sum((engine.compile_ahead if p.kind in COMPILE_ONLY_KINDS else engine.warm_up)((p,), 2) for p in pieces)
    assert built > 0 and {p.kind for p in pieces} == {"train", "sampler"}
    before = persistent_cache.counts().requests
    rng = np.random.default_rng(0)

    turn = rng.integers(1, 200, 21).astype(np.int32)  # a conversation's first turn: one whole cache block, and 5
    prefix = engine.engine.sampler.prefix
    assert prefix is not None  # on by default (--prefix-cache-tokens)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    engine.create_adapter(1, LoraConfig(rank=8, seed=2, train_unembed=False))
    # Three of the four sequence lengths fall in buckets (16, 24) that were not warmed: they round up to 32.
    for step, (n, loss) in enumerate(
        [(9, "cross_entropy"), (20, "importance_sampling"), (31, "ppo"), (23, "cross_entropy")]
    ):
        # two tenants in one batch (1 + 3 rows: the 4-row bucket), then one alone (1 row), then a forward
        results = engine.forward_backward(
            [
                ForwardBackwardInput(slot=0, data=[_datum(n, loss, rng)], loss_fn=loss),
                ForwardBackwardInput(slot=1, data=[_datum(n - 3, loss, rng) for _ in range(3)], loss_fn=loss),
            ]
        )
        results += engine.forward_backward([ForwardBackwardInput(slot=1, data=[_datum(n, loss, rng)], loss_fn=loss)])
        forward = ForwardBackwardInput(
            slot=0, data=[_datum(n, "cross_entropy", rng)], loss_fn="cross_entropy", forward_only=True
        )
        results += engine.forward_backward([forward])
        assert all(isinstance(r, ForwardBackwardResult) for r in results), results
        for slot in (0, 1):
            engine.optim_step(slot, AdamConfig(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0))
        engine.snapshot(0, f"s{step}")
        # Sampling: concurrency 1, 8, 40 and the whole slot set (coordinator batches of these many calls), prompts
        # of 3 to 30 tokens, default (EOS), explicit and empty stop lists, stop strings, base model and snapshot rows.
        for calls in (1, 8, 40, engine.sample_slots):
            requests = [
                SampleInput(
                    prompt=rng.integers(1, 200, 3 + (i * 7 + step) % 28).astype(np.int32),
                    num_samples=1 + i % 2,
                    max_tokens=4 + i % 13,
                    seed=i,
                    stop_token_ids=[None, [5, 9], [], [int(x) for x in range(1, 8)]][i % 4],  # + EOS: width 8
                    stop_strings=["the"] if i % 5 == 0 else [],
                    snapshot=f"s{step}" if i % 3 else None,
                )
                for i in range(calls)
            ]
            sampled = engine.sample(requests)
            assert all(isinstance(r, SampleResult) for r in sampled), sampled
        # Prompts that start in the prefix cache: a group of 4 samples of one prompt (after the first, they take its
        # whole blocks from the cache) and the next turn of a conversation whose first turn was cached by the group.
        group = SampleInput(
            prompt=turn,
            num_samples=4,
            max_tokens=5,
            seed=step,
            cache_namespace="session",
            snapshot=f"s{step}" if step % 2 else None,
        )
        follow = dataclasses.replace(
            group, prompt=np.concatenate([turn, rng.integers(1, 200, 9).astype(np.int32)]), num_samples=1
        )
        served = prefix.hits
        assert all(isinstance(r, SampleResult) for r in engine.sample([group]))
        assert prefix.hits - served >= 3 * 16  # the group's three later samples took the prompt's first block
        sampled = engine.sample([follow, group])
        assert all(isinstance(r, SampleResult) and r.prompt_cache_hit_tokens == 16 for r in sampled), sampled
        engine.drop_snapshot(f"s{step}")
    engine.free_adapter(1)
    engine.create_adapter(1, LoraConfig(rank=2, seed=5))

    built = persistent_cache.counts().requests - before
    assert built == 0, f"{built} programs built after the warm-up"


def _sample_at_every_concurrency_compiling_nothing(engine, prompt: np.ndarray) -> None:
    """1 call, 8 and the whole slot set of one family: every slot bucket's programs are already built."""
    sampler = engine.engine.sampler
    before = sampler.compile_count()
    for calls in (1, 8, engine.sample_slots):
        sampled = engine.sample([SampleInput(prompt=prompt, max_tokens=4, seed=i) for i in range(calls)])
        assert all(isinstance(r, SampleResult) for r in sampled)
    assert sampler.compile_count() == before


def test_the_default_plan_in_the_order_a_first_user_needs_it_and_every_piece_once():
    settings = Settings()
    first, later = jax_worker.warm_up_pieces(settings)
    # Before registering: what a first user needs to train and to sample (the adapter lifecycle: create,
    # forward_backward, optim_step, then export, import, snapshots and a sample, which builds the slot bucket a
    # first sample uses) ...
    assert [(p.kind, p.rows, p.seq) for p in first] == [("lifecycle", 1, 256), ("lifecycle_sample", 0, 0)]
    # ... right after, back to back: the 8-datum bucket, the lifecycle's own (its forward step), the first sampler
    # family's other slot buckets.
    plan = jax_worker.warm_up_plan(settings)
    assert [(p.kind, p.rows, p.seq, p.adapters, p.scoring) for p in later[: plan.first_user() - 2]] == [
        ("train", 64, 256, 1, False),
        ("train", 1, 256, 1, False),
        ("sampler", 0, 0, 1, False),
    ]
    assert sorted(first + later, key=plan.pieces().index) == list(plan.pieces())
    assert len(set(plan.pieces())) == len(plan.pieces())
    trains = {(p.rows, p.seq) for p in first + later if p.kind == "train"}
    # The whole training set for datums up to 4,096 tokens: every (rows, length) a 16,384-token micro-batch holds.
    assert trains == {(r, n) for r in (1, 4, 16, 64) for n in (256, 1024, 4096) if r * n <= 16384}
    # The whole sampler set: a family per stack size and scoring variant, each serving every prompt length.
    families = {(p.adapters, p.scoring) for p in later if p.kind == "sampler"}
    assert families == {(a, scoring) for a in (1, 4, 16) for scoring in (False, True)}
    # A restart (warm persistent cache): everything after registering (its recovery first), in the plan's order.
    assert jax_worker.warm_up_pieces(settings, warm_cache=True) == ((), plan.pieces())
    # ... but for the slot bucket a first sample takes, read back before registering (the surviving clients).
    first_sample = first_sample_piece(plan, [64, 8, 256])
    assert first_sample == dataclasses.replace(plan.pieces()[plan.first_user() - 2], slots=8)
    assert (first_sample.kind, first_sample.adapters, first_sample.scoring) == ("sampler", 1, False)
    assert jax_worker.warm_up_pieces(dataclasses.replace(settings, warm_up="off")) == ((), ())


async def test_the_background_warm_up_runs_the_urgent_pieces_at_once_then_waits_for_pauses():
    """The urgent background pieces (what a first user needs) run as soon as the worker registered, back to back
    whatever the traffic; each later one only after a pause in it."""
    import asyncio

    from tinkerflow.workers.engine.engine_lock import EngineLock

    class Fake:
        def __init__(self):
            self.ran: list[tuple[str, int, int]] = []
            self.locked: list[bool] = []

        def forward_backward(self, requests):
            return requests

        def warm_up(self, pieces, threads=1):
            self.locked.append(engine.lock.locked())
            self.ran += [("run", p.rows, threads) for p in pieces]
            return len(pieces)

        def compile_ahead(self, pieces, threads=1):
            self.locked.append(engine.lock.locked())
            self.ran += [("compile", p.rows, threads) for p in pieces]
            return len(pieces)

    fake = Fake()
    engine = EngineLock(fake)
    pieces = (
        WarmUpPiece("train", rows=8, seq=32),
        WarmUpPiece("lifecycle_sample", rows=1),
        WarmUpPiece("sampler", rows=2),
        WarmUpPiece("train", rows=4, seq=32),
    )
    engine.forward_backward([])  # traffic just now: no pause yet
    task = asyncio.create_task(jax_worker._warm_up_later(engine, pieces, threads=2, urgent=2))
    for _ in range(500):
        if len(fake.ran) >= 2:
            break
        await asyncio.sleep(0.01)
    # the urgent pieces at once, on the threads asked for; a train bucket only compiles, without the engine's turn
    assert fake.ran == [("compile", 8, 2), ("run", 1, 2)] and fake.locked == [False, True]
    engine.forward_backward([])  # traffic again: the next piece waits for a pause after it
    await asyncio.sleep(0.2)
    assert len(fake.ran) == 2, "a later piece ran before the traffic paused"
    await asyncio.wait_for(task, 30)
    assert fake.ran[2:] == [("compile", 2, 2), ("compile", 4, 2)] and engine.calls == 2

    # A restart: nothing until a request (the recovery) was served and the traffic paused, then the urgent pieces
    # back to back.
    fake.ran.clear()
    engine = EngineLock(fake)
    task = asyncio.create_task(jax_worker._warm_up_later(engine, pieces, threads=1, urgent=3, restart=True))
    await asyncio.sleep(1.5)  # idle, but no request yet: the CPU is the recovery's
    assert fake.ran == []
    engine.forward_backward([])  # the recovery
    await asyncio.wait_for(task, 30)
    assert [r[:2] for r in fake.ran] == [("compile", 8), ("run", 1), ("compile", 2), ("compile", 4)]


def test_the_background_warm_up_waits_for_a_pause_in_the_traffic_and_never_runs_beside_a_call():
    import threading

    from tinkerflow.workers.engine.engine_lock import EngineLock

    class Fake:
        def __init__(self):
            self.inside = threading.Event()
            self.release = threading.Event()

        def forward_backward(self, requests):
            self.inside.set()
            self.release.wait(10)
            return requests

        def warm_up(self, pieces, threads=1):
            return len(pieces)

    fake = Fake()
    engine = EngineLock(fake)
    call = threading.Thread(target=engine.forward_backward, args=([1],))
    call.start()
    assert fake.inside.wait(10)
    assert engine.idle_seconds() == 0.0  # a call in progress: no warm-up piece starts
    assert not engine.lock.acquire(blocking=False)  # and a piece would wait for it
    fake.release.set()
    call.join(10)
    pieces = (WarmUpPiece("train"), WarmUpPiece("sampler"))
    assert engine.warm_up(pieces) == 2 and engine.idle_seconds() > 0.0  # a warm-up is not traffic
    assert engine.calls == 1


def test_a_first_sample_before_the_background_warm_up_compiles_its_own_slot_bucket_only(qwen3_dir):
    """`--warm-up background` schedules the first sampler family: a first 1-row sample that comes before the warm-up
    built it compiles the smallest slot bucket's programs (empty slots, admission, decode chunk), not every bucket's;
    the warm-up's pieces then build the others, and the same family at any concurrency compiles nothing more."""
    settings = dataclasses.replace(_settings(), warm_up="background")
    engine = jax_worker.start_engine(settings, str(qwen3_dir), pieces=())
    sampler = engine.engine.sampler
    assert len(engine.slot_buckets) > 1
    prompt = np.arange(1, 6, dtype=np.int32)
    before = sampler.compile_count()
    (result,) = engine.sample([SampleInput(prompt=prompt, max_tokens=4, seed=0)])
    assert isinstance(result, SampleResult) and len(result.sequences[0].tokens) <= 4
    assert sampler.compile_count() - before == 3  # one bucket: slots, admission, decode chunk
    plan = jax_worker.warm_up_plan(settings)
    family = [p for p in plan.pieces()[: plan.first_user()] if p.kind == "sampler"]
    for piece in split_by_slot_bucket(tuple(family), engine.slot_buckets):
        engine.warm_up((piece,))
    _sample_at_every_concurrency_compiling_nothing(engine, prompt)


def test_a_sampler_family_compiled_from_shapes_touches_nothing_a_call_uses(qwen3_dir):
    """The background warm-up compiles sampler families beside the traffic, without the engine's turn: from shapes
    alone it allocates no slots, makes no prefix-cache pool and records no family, so a call running meanwhile finds
    the sampler as it left it; the programs it built are the ones a sample then runs (nothing more compiles)."""
    import threading

    settings = dataclasses.replace(_settings(), warm_up="background")
    engine = jax_worker.start_engine(settings, str(qwen3_dir), pieces=())
    sampler = engine.engine.sampler
    plan = jax_worker.warm_up_plan(settings)
    family = tuple(p for p in plan.pieces() if p.kind == "sampler")[:1]
    with engine.lock:  # a call holds the engine throughout: the compile must not need its turn
        done = threading.Event()
        worker = threading.Thread(target=lambda: (engine.compile_ahead(family), done.set()))
        worker.start()
        assert done.wait(300), "compile_ahead waited for the engine's lock"
    worker.join()
    assert sampler.compile_count() == 3 * len(engine.slot_buckets)  # slots, admission, decode chunk per bucket
    assert sampler.release_idle() == 0 and sampler.prefix is None and not sampler._families  # pyright: ignore[reportPrivateUsage]
    _sample_at_every_concurrency_compiling_nothing(engine, np.arange(1, 6, dtype=np.int32))
