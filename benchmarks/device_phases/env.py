"""env: versions, the device, a bf16 matmul's TFLOP/s and a device-to-device copy's GB/s (the measured peaks)."""

from __future__ import annotations

import sys

from benchmarks.device_phases.measure import emit, timed


def phase_env(smoke: bool) -> None:
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    emit(
        phase="env",
        figure="env",
        jax=jax.__version__,
        flax=flax.__version__,
        numpy=np.__version__,
        python=sys.version.split()[0],
        backend=jax.default_backend(),
        device=dev.device_kind,
        devices=jax.device_count(),
        memory_limit_gib=round(stats["bytes_limit"] / 2**30, 1) if stats else None,
    )
    n = 512 if smoke else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    s = min(timed(lambda: mm(a), 3 if smoke else 10))
    emit(phase="env", figure="bf16_matmul_tflops", n=n, tflops=round(2 * n**3 / s / 1e12, 1), seconds=s)
    size = (2**20 if smoke else 2**30) // 4  # float32 elements: 4 MiB / 4 GiB
    x = jnp.ones((size,), jnp.float32)
    cp = jax.jit(lambda x: x + 1)
    s = min(timed(lambda: cp(x), 3 if smoke else 10))
    emit(
        phase="env",
        figure="hbm_copy_gb_per_s",
        gib=round(size * 4 / 2**30, 3),
        gb_per_s=round(2 * size * 4 / s / 1e9, 1),
        convention="bytes read + written",
    )
