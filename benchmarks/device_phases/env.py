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
    # Random inputs: on constants (all ones) the tensor cores toggle fewer bits and draw less power, so a
    # constant-input peak can read higher than any real matmul reaches.
    keys = jax.random.split(jax.random.key(0), 2)
    a = jax.random.normal(keys[0], (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(keys[1], (n, n), jnp.float32).astype(jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    s = min(timed(lambda: mm(a, b), 3 if smoke else 10))
    emit(
        phase="env",
        figure="bf16_matmul_tflops",
        n=n,
        tflops=round(2 * n**3 / s / 1e12, 1),
        seconds=s,
        inputs="random normal",
    )
    gib, gb_per_s = copy_gb_per_s(smoke)
    emit(phase="env", figure="hbm_copy_gb_per_s", gib=gib, gb_per_s=gb_per_s, convention="bytes read + written")


def copy_gb_per_s(smoke: bool) -> tuple[float, float]:
    """A device-to-device elementwise pass over random float32 data: (GiB read, GB/s read + written). The sample
    phase takes its decode floor over this, measured in its own process."""
    import jax
    import jax.numpy as jnp

    size = (2**20 if smoke else 2**30) // 4  # float32 elements: 4 MiB / 4 GiB
    x = jax.random.uniform(jax.random.key(1), (size,), jnp.float32)
    cp = jax.jit(lambda x: x + 1)
    s = min(timed(lambda: cp(x), 3 if smoke else 10))
    return round(size * 4 / 2**30, 3), round(2 * size * 4 / s / 1e9, 1)
