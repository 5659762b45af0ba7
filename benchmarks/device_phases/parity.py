"""parity: bf16 against float32 weights, whether float32 matmuls run as TF32, GPU against CPU in float32, and every
attention implementation against the reference with gradients."""

from __future__ import annotations

from benchmarks.device_phases.attention import attention_parity
from benchmarks.device_phases.measure import emit
from benchmarks.device_phases.shapes import QWEN3_06B_2L, TINY


def logprobs(engine, tokens):
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput

    req = ForwardBackwardInput(
        slot=0, data=[Datum(tokens[:-1], {"target_tokens": tokens[1:]})], loss_fn="cross_entropy", forward_only=True
    )
    [res] = engine.forward_backward([req])
    return res.outputs[0]["logprobs"]


def phase_parity(smoke: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.sharding import MeshConfig
    from tinkerflow.workers.engine.types import LoraConfig

    # float32 matmul: TF32 or true float32? (relative error against float64 on the host)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(256, 256)).astype(np.float32), rng.normal(size=(256, 256)).astype(np.float32)
    got = np.asarray(jax.jit(jnp.matmul)(a, b), np.float64)
    rel = float(np.max(np.abs(got - a.astype(np.float64) @ b)) / np.max(np.abs(a.astype(np.float64) @ b)))
    emit(
        phase="parity",
        figure="float32_matmul",
        rel_err=rel,
        looks_like="tf32" if rel > 1e-4 else "float32",
        default_matmul_precision=str(jax.config.values.get("jax_default_matmul_precision")),
    )

    cfg = TINY if smoke else QWEN3_06B_2L
    tokens = rng.integers(1, cfg["vocab_size"], 257 if not smoke else 65).astype(np.int32)
    out = {}
    for name, dtype, devices in (("f32", "float32", None), ("bf16", "bfloat16", None), ("cpu_f32", "float32", "cpu")):
        mesh = MeshConfig(fsdp=1, tp=1).build(jax.devices("cpu")) if devices == "cpu" else None
        engine = Engine.random(cfg, max_lora_adapters=1, max_lora_rank=8, seed=1, dtype=dtype, mesh=mesh)
        engine.create_adapter(0, LoraConfig(rank=8, seed=0))
        out[name] = logprobs(engine, tokens)
        del engine
    for pair in (("bf16", "f32"), ("f32", "cpu_f32")):
        d = np.abs(out[pair[0]] - out[pair[1]])
        emit(
            phase="parity",
            figure=f"logprobs_{pair[0]}_vs_{pair[1]}",
            max_abs=float(d.max()),
            mean_abs=float(d.mean()),
            tokens=len(tokens) - 1,
            shape="tiny" if smoke else "qwen3-0.6b x 2 layers",
        )
    attention_parity(smoke)
