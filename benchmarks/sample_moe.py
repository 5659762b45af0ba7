"""Sampling on the MoE shape (benchmarks/moe_shape.py) in the engine alone, against a bare jitted JAX decode loop
doing the same math (the engine's NNX model with its KV cache, greedy, one token per row per step, no adapters, no
sampler bookkeeping). Prints one JSON line per figure; called by `python -m benchmarks.sample --moe`.

    python -m benchmarks.sample_moe [--rows N] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit
from benchmarks.moe_shape import QWEN3_30B_A3B_1L, write_random_checkpoint

NEW_TOKENS = 32
PROMPT = 16
SHAPE_NAME = "qwen3-30b-a3b-1l"


def engine_tokens_per_s(engine, rows: int, repeats: int) -> float:
    from tinkerflow.workers.engine.types import SampleInput

    rng = np.random.default_rng(0)
    reqs = [
        SampleInput(
            prompt=rng.integers(1, 1000, PROMPT).astype(np.int32),
            max_tokens=NEW_TOKENS,
            temperature=1.0,
            stop_token_ids=[],
            seed=i,
        )
        for i in range(rows)
    ]
    engine.sample(reqs)  # compiles
    tokens, t0 = 0, time.perf_counter()
    for _ in range(repeats):
        tokens += sum(len(s.tokens) for r in engine.sample(reqs) for s in r.sequences)
    return tokens / (time.perf_counter() - t0)


def bare_tokens_per_s(engine, rows: int, repeats: int) -> float:
    """Prefill + NEW_TOKENS greedy decode steps of the same model under one jit, device-resident inputs."""
    from flax import nnx

    from tinkerflow.workers.engine.model.kv_cache import empty_cache
    from tinkerflow.workers.engine.model.lora import LoraRouting

    graphdef, base, lora = engine._graphdef, engine._base, engine.adapters.lora
    config = engine.config
    routing = LoraRouting(adapter=jnp.zeros((rows,), jnp.int32), scale=jnp.zeros((rows,), jnp.float32))
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, 1000, (rows, PROMPT)).astype(np.int32))

    @jax.jit
    def generate(lora, base, prompt):
        model = nnx.merge(graphdef, lora, base)
        cache = empty_cache(config, rows, PROMPT + NEW_TOKENS, model.dtype)
        positions = jnp.broadcast_to(jnp.arange(PROMPT), (rows, PROMPT))
        h, cache = model.hidden(prompt, positions, routing, cache)
        token = jnp.argmax(model.logits(h[:, -1:], routing)[:, 0], axis=-1)

        def step(i, carry):
            token, cache, out = carry
            pos = jnp.full((rows, 1), PROMPT + i, jnp.int32)
            h, cache = model.hidden(token[:, None], pos, routing, cache)
            nxt = jnp.argmax(model.logits(h, routing)[:, 0], axis=-1)
            return nxt, cache, out.at[:, i].set(nxt)

        out = jnp.zeros((rows, NEW_TOKENS), jnp.int32)
        return jax.lax.fori_loop(0, NEW_TOKENS, step, (token, cache, out))[2]

    jax.block_until_ready(generate(lora, base, prompt))
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(generate(lora, base, prompt))
    return rows * NEW_TOKENS * repeats / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="concurrent sequences (default 8)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args(argv)

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    with tempfile.TemporaryDirectory(prefix="tinkerflow-sample-moe-", dir=args.workdir) as work:
        work = Path(work)
        tiny = make_tiny_model(work / "tiny")
        model_dir = write_random_checkpoint(work / SHAPE_NAME, QWEN3_30B_A3B_1L, dtype, tiny)
        engine = Engine.load(str(model_dir), max_lora_adapters=2, max_lora_rank=8, progress=False)
        common = dict(
            shape=SHAPE_NAME,
            rows=args.rows,
            prompt=PROMPT,
            new_tokens=NEW_TOKENS,
            dtype=str(engine.dtype),
            backend=jax.default_backend(),
        )
        ours = engine_tokens_per_s(engine, args.rows, args.repeats)
        bare = bare_tokens_per_s(engine, args.rows, args.repeats)
    emit(figure="sample_tokens_per_s", path="engine", **common, tokens_per_s=round(ours, 1))
    emit(figure="sample_tokens_per_s", path="bare_jax", **common, tokens_per_s=round(bare, 1))
    emit(figure="engine_vs_bare_ratio", **common, ratio=round(ours / bare, 3))


if __name__ == "__main__":
    main()
