"""The sampler's layer loop over stacked layers (model/decoder_stack.py): `unrolled` samples exactly what `scan`
samples, builds as many programs, and writes the KV cache in place.

Exact, not close: float32 weights on CPU, and the two loops run the same operations on the same values in the same
order (the layer's weights a static slice of the stack instead of a dynamic one), so the sampled tokens and their
logprobs are asserted equal, bit for bit. Memory is counted from XLA's memory analysis of the compiled decode step,
never timed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MAX_ADAPTERS, MAX_RANK
from flax import nnx
from small_qwen3 import qwen3_config

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.decoder import CausalLM
from tinkerflow.workers.engine.model.decoder_stack import DecodeLayers, resolve_decode_layers
from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.kv_cache import LayerCache
from tinkerflow.workers.engine.model.lora import StackedLoraRouting
from tinkerflow.workers.engine.sampling.prefix_cache import BLOCK
from tinkerflow.workers.engine.types import LoraConfig, SampleInput, SampleResult


def test_auto_unrolls_on_accelerators_and_scans_on_cpu():
    assert resolve_decode_layers("auto", "cpu") == "scan"
    assert resolve_decode_layers("auto", "gpu") == resolve_decode_layers("auto", "tpu") == "unrolled"
    assert resolve_decode_layers("scan", "gpu") == "scan" and resolve_decode_layers("unrolled", "cpu") == "unrolled"
    with pytest.raises(ValueError, match="scan, unrolled, auto"):
        resolve_decode_layers("loop")


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    """Its own engine: the switch between the two loops is per engine, and the counts below are its compiles."""
    logging.getLogger("tinkerflow").setLevel(logging.INFO)
    engine = Engine.load(
        str(qwen3_dir), max_lora_adapters=MAX_ADAPTERS, max_lora_rank=MAX_RANK, progress=False, decode_layers="scan"
    )
    assert engine.sampler.programs.decode_layers == "scan"
    engine.sample_slots = 8  # one slot bucket: fewer programs to compile
    engine.create_adapter(1, LoraConfig(rank=4, seed=3))
    # A LoRA that changes the logits: B starts at zero (PEFT's init), so give it weights.
    weights = engine.adapter_weights(1)
    rng = np.random.default_rng(0)
    engine.set_adapter_weights(1, {k: rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in weights.items()})
    engine.snapshot(1, "tuned")
    return engine


def _workload(engine: Engine, layers: DecodeLayers) -> tuple[list[SampleResult], int]:
    """Greedy and seeded-temperature samples of a prompt of two whole blocks and more, then of a second turn that
    starts with them (a prefix-cache hit), in a namespace of this loop's own so both loops miss, then hit; returns
    the results and the admission and decode programs it built."""
    programs = engine.sampler.programs
    programs.decode_layers = layers
    before = programs.admit.compiles + programs.decode.compiles
    rng = np.random.default_rng(1)
    first = rng.integers(1, 300, size=2 * BLOCK + 5).astype(np.int32)
    second = np.concatenate([first, rng.integers(1, 300, size=7).astype(np.int32)])
    results: list[SampleResult] = []
    for prompt in (first, second):
        requests = [
            SampleInput(prompt=prompt, max_tokens=10, temperature=0.0, stop_token_ids=[], snapshot="tuned"),
            SampleInput(prompt=prompt, num_samples=3, max_tokens=10, seed=11, stop_token_ids=[], snapshot="tuned"),
            SampleInput(prompt=prompt, max_tokens=10, seed=5, temperature=0.7, stop_token_ids=[], snapshot=None),
        ]
        for r in engine.sample([_in(r, f"loop-{layers}") for r in requests]):
            assert isinstance(r, SampleResult), r
            results.append(r)
    return results, programs.admit.compiles + programs.decode.compiles - before


def _in(request: SampleInput, namespace: str) -> SampleInput:
    return dataclasses.replace(request, cache_namespace=namespace)


def test_unrolled_samples_exactly_what_the_scan_samples_with_as_many_programs(engine):
    scan, scan_programs = _workload(engine, "scan")
    unrolled, unrolled_programs = _workload(engine, "unrolled")
    hits = [r.prompt_cache_hit_tokens for r in scan]
    # The first turn's first request misses (the other requests of its call may find its blocks); the second turn
    # hits its whole blocks.
    assert hits[0] == 0 and all(h >= 2 * BLOCK for h in hits[3:]), hits
    assert [r.prompt_cache_hit_tokens for r in unrolled] == hits
    for a, b in zip(scan, unrolled, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(np.asarray(sa.logprobs), np.asarray(sb.logprobs))
    # Each loop's admissions (hits and misses alike) and decode chunks are one program set of the same size.
    assert scan_programs > 0 and unrolled_programs == scan_programs
    # The loop switched back finds its programs: nothing compiles again.
    assert _workload(engine, "scan")[1] == 0


def _config(layers: int) -> ModelConfig:
    return qwen3_config(layers, max_position=512)


def _decode_step(layers: DecodeLayers, rows: int = 8, length: int = 512, depth: int = 8):
    """One decode step (every row one token, the whole [L, B, S, kv, hd] cache donated) of an 8-layer model,
    compiled from abstract shapes: (XLA's memory analysis, its HLO text, the cache's bytes)."""
    config = _config(depth)
    model = nnx.eval_shape(lambda: CausalLM(config, max_adapters=2, max_rank=4, rngs=nnx.Rngs(0)))
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, nnx.Param)
    spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    shape = (depth, rows, length, config.num_kv_heads, config.head_dim)
    abstract = cast(jax.Array, jax.ShapeDtypeStruct(shape, jnp.float32))  # lowered, never computed
    cache = LayerCache(abstract, abstract)

    def step(lora, base, cache, tokens, positions):
        m: Any = nnx.merge(graphdef, lora, base)  # called as the sampler calls it (decode.py)
        m.decode_layers = layers
        routing = StackedLoraRouting(adapter=jnp.zeros((rows,), jnp.int32), scale=jnp.ones((rows,), jnp.float32))
        h, cache = m.hidden(tokens, positions, routing, cache)
        return m.logits(h, routing), cache

    token = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
    compiled = jax.jit(step, donate_argnums=(2,)).lower(spec(lora), spec(base), cache, token, token).compile()
    stats, text = compiled.memory_analysis(), compiled.as_text()
    assert stats is not None and text is not None  # XLA's CPU backend answers both
    return stats, text, 2 * int(np.prod(shape)) * 4


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
def test_the_decode_step_writes_the_donated_cache_in_place(layers: DecodeLayers):
    """The cache is the step's output in the donated buffers (aliased whole), and the temporaries are less than one
    cache: no layer copies the cache (the unrolled loop's 8 writes would otherwise take 8 caches)."""
    stats, _, cache_bytes = _decode_step(layers)
    assert stats.alias_size_in_bytes == cache_bytes
    assert stats.temp_size_in_bytes < cache_bytes, (stats.temp_size_in_bytes, cache_bytes)


def test_the_unrolled_loop_slices_the_stacks_statically():
    """The scan reads each layer's weights by dynamic slices; the unrolled loop by static ones, none dynamic (the
    cache's block reads included: their layer index is a constant XLA folds)."""
    _, scan, _ = _decode_step("scan")
    _, unrolled, _ = _decode_step("unrolled")
    assert "dynamic-slice(" in scan
    assert "dynamic-slice(" not in unrolled and re.search(r"\bslice\(", unrolled)


def test_a_stack_layer_view_is_a_static_slice():
    config = _config(3)
    model = CausalLM(config, max_adapters=2, max_rank=4, rngs=nnx.Rngs(0))
    jaxpr = str(
        jax.make_jaxpr(lambda state: nnx.merge(nnx.graphdef(model), state).layers[2].mlp.up_proj.kernel[...])(
            nnx.state(model)
        )
    )
    assert "slice[" in jaxpr and "dynamic_slice" not in jaxpr
