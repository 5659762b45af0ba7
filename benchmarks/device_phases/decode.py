"""The sample phase: decode ms per step against the HBM floor, with each of the sampler's layer loops (`scan`, and
`unrolled` over static slices of the stacked weights: workers/engine/model/decoder_stack.py) in the same run, so one
GPU session compares them.

The step time is the sampler's decode program timed alone: its call (a chunk of decode steps over every slot, the
whole completion when no row has stop strings) made to wait for its output, over the steps it ran, the least of a
few repetitions. It includes the call's fixed cost spread over its steps (an upper bound on a step, never below
zero), and nothing of the admissions (prefill), which are timed the same way, one call at a time, and reported
beside it (`admit_ms`). The earlier figure, (a 64-token sample's wall time - a 16-token one's) / 48, also carried
the host's noise and the admissions', and came out negative on a busy CPU.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.device_phases.env import copy_gb_per_s
from benchmarks.device_phases.flops import decode_floor_bytes
from benchmarks.device_phases.measure import emit, profile_top

LAYER_LOOPS = ("scan", "unrolled")
PROMPT_LEN = 64
MAX_TOKENS = 64  # the first token is sampled at admission: 63 decode steps
REPEATS = 3  # timed samples per shape and loop (2 with --smoke)


class ProgramTimer:
    """Times the sampler's admission and decode calls while installed (`with`): each call waits for its output,
    so its wall time is the program's; the decode's steps are read from its slots (the most tokens a slot decoding
    at the call gained in it)."""

    def __init__(self, sampler: Any):
        self.programs = sampler.programs
        self.admit_s: list[float] = []
        self.decode: list[tuple[float, int]] = []  # (seconds, steps)

    def __enter__(self) -> ProgramTimer:
        import jax
        import numpy as np

        programs, admit, decode = self.programs, self.programs.admit_call, self.programs.decode_call

        def admit_call(*args, **kw):
            t0 = time.perf_counter()
            out = admit(*args, **kw)
            if not kw.get("compile_only"):
                jax.block_until_ready(out[0].n_gen)
                self.admit_s.append(time.perf_counter() - t0)
            return out

        def decode_call(lora, base, bucket, slots, release, *args, **kw):
            if kw.get("compile_only"):
                return decode(lora, base, bucket, slots, release, *args, **kw)
            # Read before the call donates them (and waits for the admissions before it): the slots that decode.
            n_gen, done = jax.device_get((slots.n_gen, slots.done))
            active = ~(done | release)
            t0 = time.perf_counter()
            out = decode(lora, base, bucket, slots, release, *args, **kw)
            after = jax.device_get(out.n_gen)  # waits for the program
            seconds = time.perf_counter() - t0
            self.decode.append((seconds, int(np.max(after[active] - n_gen[active], initial=0))))
            return out

        # Instance attributes over the class's methods: the sampler calls them as programs.admit_call(...).
        programs.admit_call, programs.decode_call = admit_call, decode_call
        return self

    def __exit__(self, *exc) -> None:
        del self.programs.admit_call, self.programs.decode_call


def phase_sample(phases: Any) -> None:
    """Decode at each (rows, adapters) shape, once per layer loop; one line each (`decode_layers`)."""
    import numpy as np

    from tinkerflow.workers.engine.types import SampleInput

    engine, smoke, budget = phases.engine, phases.smoke, phases.budget
    for slot in range(8):
        engine.snapshot(slot, f"s{slot}")
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, phases.vocab, PROMPT_LEN).astype(np.int32)
    kv_token = engine.memory.kv_bytes_per_token
    weights, embedding = phases._weight_bytes()
    tied = bool(phases.cfg.get("tie_word_embeddings"))
    _, copy_gb_s = copy_gb_per_s(smoke)  # measured here: the env phase ran in another process
    # On CPU (--smoke) a small shape of one adapter and one of several: each loop compiles its own programs at every
    # shape, and a CPU prefills 256 rows slowly.
    shapes = ((8, 1), (64, 8)) if smoke else ((64, 1), (256, 1), (256, 8))
    shapes = [(256, 1)] if phases.quick else shapes
    profiled = (256, 1) if (256, 1) in shapes else shapes[-1]  # a shape measured: its programs are built
    programs = engine.sampler.programs
    default = programs.decode_layers
    repeats = 2 if smoke else REPEATS
    for rows, adapters in shapes:
        reqs = [
            SampleInput(prompt=prompt, max_tokens=MAX_TOKENS, seed=i, stop_token_ids=[], snapshot=f"s{i % adapters}")
            for i in range(rows)
        ]
        for layers in LAYER_LOOPS:
            figure: dict[str, Any] = dict(phase="sample", figure="decode_ms_per_step", rows=rows, adapters=adapters)
            figure.update(decode_layers=layers, engine_default=layers == default)
            if budget.left() < (3 if smoke else 30):
                emit(**figure, skipped="budget")
                continue
            programs.decode_layers = layers
            try:
                t0 = time.perf_counter()
                _sample(engine, reqs)  # compiles this loop's programs at this shape
                first = time.perf_counter() - t0
                with ProgramTimer(engine.sampler) as timer:
                    for _ in range(repeats):
                        _sample(engine, reqs)
                seconds, steps = min((s / n, n) for s, n in timer.decode if n > 0)
                kv_read = rows * (PROMPT_LEN + (steps + 1) / 2) * kv_token  # the mean filled length over the steps
                floor_bytes = decode_floor_bytes(weights, embedding, tied, int(kv_read))
                floor_ms = floor_bytes / (copy_gb_s * 1e9) * 1000
                emit(
                    **figure,
                    ms=round(seconds * 1000, 3),
                    ms_is="the decode program's call, waited for, over the steps it ran; least of the repetitions",
                    steps=steps,
                    ms_all=[round(s / n * 1000, 3) for s, n in timer.decode if n > 0],
                    admit_ms=round(min(timer.admit_s) * 1000, 3) if timer.admit_s else None,
                    admit_is="one admission call (a chunk of prompts prefilled), waited for; least of them",
                    admit_calls_per_sample=len(timer.admit_s) // repeats,
                    first_call_s=round(first, 2),
                    weights_gib=round(weights / 2**30, 2),
                    kv_read_gib=round(kv_read / 2**30, 3),
                    embedding_gib_excluded=0 if tied else round(embedding / 2**30, 2),
                    floor_bytes=floor_bytes,
                    copy_gb_per_s=copy_gb_s,
                    floor_ms=round(floor_ms, 3),
                    floor_ratio=round(seconds * 1000 / floor_ms, 2),
                    floor_is="weights once (embedding table excluded unless tied) + KV filled, over measured copy GB/s",
                    tokens_per_s=round(rows / seconds),
                )
            except Exception as e:  # noqa: BLE001
                emit(**figure, error=f"{type(e).__name__}: {str(e)[:400]}")
    rows, adapters = profiled
    reqs = [
        SampleInput(prompt=prompt, max_tokens=MAX_TOKENS, seed=i, stop_token_ids=[], snapshot=f"s{i % adapters}")
        for i in range(rows)
    ]
    for layers in LAYER_LOOPS:  # where each loop's decode time goes
        if budget.left() > (3 if smoke else 25):
            programs.decode_layers = layers
            label = f"sample, {rows} rows x {MAX_TOKENS} tokens, {adapters} adapters, {layers} layers"
            profile_top(label, lambda: engine.sample(reqs))
    programs.decode_layers = default


def _sample(engine: Any, reqs: list) -> None:
    res = engine.sample(reqs)
    bad = [r for r in res if not hasattr(r, "sequences")]
    if bad:
        raise RuntimeError(f"sample refused: {bad[0]}")
