"""AotCache under concurrent `prepare` (the warm-up compiles train buckets side by side): each shape is
compiled once however many threads ask for it, and an executable prepared from `abstract` shapes serves the real
arrays without another build. Counted with JAX's compile events, never timed."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

from tinkerflow.workers.engine.runtime import persistent_cache
from tinkerflow.workers.engine.runtime.aot_cache import AotCache, abstract


def _step(acc, x, *, scale):
    return acc + scale * jnp.tanh(x @ x.T).sum(), x * 2


def test_concurrent_prepare_compiles_each_shape_once_and_abstract_shapes_serve_real_arrays():
    cache = AotCache("test step", _step, donate=("acc",))
    shapes = [(4, 8), (16, 8), (4, 8), (16, 8), (4, 8), (32, 8)] * 2  # three distinct shapes, each asked 4 times
    args = [(jnp.zeros(()), jnp.ones(s, jnp.float32)) for s in shapes]
    before = persistent_cache.counts().requests
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        executables = list(pool.map(lambda a: cache.prepare("t", *abstract(a), scale=2.0), args))
    assert persistent_cache.counts().requests - before == 3
    assert len({id(e) for e, s in zip(executables, shapes) if s == (4, 8)}) == 1  # one executable per shape
    assert len(cache._compiled) == 3
    # The executables run on the real (committed, donated) arrays; nothing else is built.
    before = persistent_cache.counts().requests
    acc, out = cache("t", jnp.zeros(()), jnp.ones((16, 8), jnp.float32), scale=2.0)
    assert persistent_cache.counts().requests - before == 0
    np.testing.assert_allclose(float(acc), 2.0 * 16 * 16 * np.tanh(8.0), rtol=1e-6)  # float32, 256 equal terms
    assert out.shape == (16, 8)


def test_abstract_keeps_shapes_dtypes_and_shardings_and_leaves_other_leaves():
    x = jax.device_put(np.arange(6, dtype=np.int32).reshape(2, 3))
    tree = {"a": x, "n": 3, "s": None}
    spec = abstract(tree)
    assert isinstance(spec["a"], jax.ShapeDtypeStruct)
    assert (spec["a"].shape, spec["a"].dtype, spec["a"].sharding) == (x.shape, x.dtype, x.sharding)
    assert spec["n"] == 3 and spec["s"] is None


def test_needed_bytes_reads_each_programs_memory_analysis_once():
    """The memory plan asks before every micro-batch: XLA's analysis of a program is read once and kept (it is fixed
    per executable, and reading it cost as much CPU as a small step), per shape."""
    cache = AotCache("test step", _step, donate=("acc",))
    small = (jnp.zeros(()), jnp.ones((4, 8), jnp.float32))
    first = cache.needed_bytes("t", *small, scale=2.0)
    (key,) = cache._compiled  # pyright: ignore[reportPrivateUsage]

    class Unreadable:
        def memory_analysis(self):
            raise AssertionError("memory_analysis read a second time")

    real = cache._compiled[key]  # pyright: ignore[reportPrivateUsage]
    cache._compiled[key] = Unreadable()  # pyright: ignore[reportPrivateUsage, reportArgumentType]
    assert cache.needed_bytes("t", *small, scale=2.0) == first
    cache._compiled[key] = real  # pyright: ignore[reportPrivateUsage]
    bigger = cache.needed_bytes("t", jnp.zeros(()), jnp.ones((64, 8), jnp.float32), scale=2.0)
    assert bigger >= first and len(cache._compiled) == 2  # pyright: ignore[reportPrivateUsage]
