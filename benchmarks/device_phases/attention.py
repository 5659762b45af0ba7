"""attention: each attention implementation's forward+backward at 8K and 32K tokens with Qwen3-8B's heads, and its
agreement with the reference (run by the parity phase)."""

from __future__ import annotations

from benchmarks.device_phases.flops import causal_pairs
from benchmarks.device_phases.measure import emit, timed


def _attention_inputs(t: int, heads: int, kv: int, d: int, dtype, seed: int = 0, packed: bool = False):
    import jax
    import jax.numpy as jnp
    import numpy as np

    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (1, t, heads, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (1, t, kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (1, t, kv, d), jnp.float32).astype(dtype)
    seg = np.ones((1, t), np.int32)
    seg[0, t - t // 8 :] = 0  # right padding
    if packed:
        seg[0, t // 3 : t - t // 8] = 2
    return q, k, v, jnp.asarray(seg)


def segment_lengths(seg) -> list[int]:
    """Tokens of each real (nonzero) segment id of a [1, T] segment array: the sequences attention serves."""
    import numpy as np

    ids, counts = np.unique(np.asarray(seg), return_counts=True)
    return [int(c) for i, c in zip(ids, counts) if i != 0]


def _attention_fn(impl: str, single: bool):
    from tinkerflow.workers.engine.model.attention import attention

    return lambda q, k, v, seg: attention(q, k, v, seg, seg, single_segment=single, implementation=impl)  # type: ignore[arg-type]


def _attention_grad(impl: str, single: bool):
    import jax
    import jax.numpy as jnp

    fn = _attention_fn(impl, single)

    def loss(q, k, v, seg, w):
        return jnp.sum(fn(q, k, v, seg) * w)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _impls() -> list[str]:
    import jax

    backend = jax.default_backend()
    out = ["reference", "blockwise"]
    if backend == "gpu":
        out += ["cudnn", "pallas_gpu"]
    if backend == "tpu":
        out += ["pallas_tpu"]
    return out


def attention_parity(smoke: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    t = 256 if smoke else 2048
    for dtype in (jnp.float32, jnp.bfloat16):
        for packed in (False, True):
            q, k, v, seg = _attention_inputs(t, 8, 2, 64, dtype, packed=packed)
            w = jax.random.normal(jax.random.key(9), (1, t, 8 * 64), jnp.float32)
            ref_val, ref_grads = _attention_grad("reference", not packed)(q, k, v, seg, w)
            for impl in _impls()[1:]:
                if impl == "cudnn" and (packed or dtype == jnp.float32):
                    continue  # cuDNN serves unpacked bf16 rows only (attention.select)
                try:
                    val, grads = _attention_grad(impl, not packed)(q, k, v, seg, w)
                    errs = [
                        float(
                            jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                            / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-9)
                        )
                        for a, b in zip(grads, ref_grads)
                    ]
                    emit(
                        phase="parity",
                        figure="attention_vs_reference",
                        impl=impl,
                        dtype=jnp.dtype(dtype).name,
                        packed=packed,
                        tokens=t,
                        loss_rel_err=float(abs(val - ref_val) / (abs(ref_val) + 1e-9)),
                        grad_rel_err_qkv=[round(e, 7) for e in errs],
                    )
                except Exception as e:  # noqa: BLE001 - a kernel that fails here is a finding, not a stop
                    emit(
                        phase="parity",
                        figure="attention_vs_reference",
                        impl=impl,
                        dtype=jnp.dtype(dtype).name,
                        packed=packed,
                        error=f"{type(e).__name__}: {str(e)[:300]}",
                    )
    del np


def phase_attention(smoke: bool) -> None:
    import jax
    import jax.numpy as jnp

    heads, kv, d = (4, 2, 16) if smoke else (32, 8, 128)
    for t in (512, 1024) if smoke else (8192, 32768):
        for impl in _impls():
            if impl == "reference" and t > 8192:
                continue  # its scores alone would be [heads, T, T] float32
            for packed in (
                (False, True) if impl in ("blockwise", "pallas_gpu", "pallas_tpu") else (impl == "reference",)
            ):
                q, k, v, seg = _attention_inputs(t, heads, kv, d, jnp.bfloat16, packed=packed)
                w = jnp.ones((1, t, heads * d), jnp.float32)
                step = _attention_grad(impl, not packed)
                try:
                    s = timed(lambda step=step, q=q, k=k, v=v, seg=seg, w=w: step(q, k, v, seg, w), 3)
                    pairs = causal_pairs(segment_lengths(seg))
                    flops = 4 * pairs * heads * d * 3.5  # forward QK^T and PV (2·d each) + backward (2.5x)
                    emit(
                        phase="attention",
                        figure="attention_fwd_bwd",
                        impl=impl,
                        tokens=t,
                        real_tokens=int((seg > 0).sum()),
                        causal_pairs=pairs,
                        packed=packed,
                        ms=round(min(s) * 1000, 2),
                        tflops=round(flops / min(s) / 1e12, 1),
                        tflops_counts="real causal pairs only (no padding, no cross-sequence pairs); backward 2.5x",
                    )
                except Exception as e:  # noqa: BLE001
                    emit(
                        phase="attention",
                        figure="attention_fwd_bwd",
                        impl=impl,
                        tokens=t,
                        packed=packed,
                        error=f"{type(e).__name__}: {str(e)[:300]}",
                    )
    del jax
