"""AotCache under concurrent `prepare` (the warm-up compiles train buckets side by side): each shape is
compiled once however many threads ask for it, and an executable prepared from `abstract` shapes serves the real
arrays without another build. Under the program budget, the least recently used programs of all caches are dropped
past a count or a byte bound and build again, with the same results, when next used. Counted with JAX's compile
events, never timed."""

from __future__ import annotations

import concurrent.futures
import gc

import jax
import jax.numpy as jnp
import numpy as np

from tinkerflow.workers.engine.runtime import aot_cache, persistent_cache
from tinkerflow.workers.engine.runtime.aot_cache import AotCache, abstract
from tinkerflow.workers.engine.runtime.program_budget import UNKNOWN_PROGRAM_BYTES, ProgramBudget, program_bytes


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
    assert cache.compiled_count == 3 and cache.compiles == 3
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
    assert bigger >= first and cache.compiled_count == 2


# --- the program budget (program_budget.py): each test has its own, so the process's programs stay as they are


def _args(rows: int):
    return jnp.zeros(()), jnp.arange(rows * 8, dtype=jnp.float32).reshape(rows, 8) / 100


def _held(cache: AotCache) -> set[int]:
    """Rows of the shapes `cache` holds an executable for."""
    keys: list = list(cache._compiled)  # pyright: ignore[reportPrivateUsage]  ((shapes, static) pairs)
    return {key[0][1][1][0][0] for key in keys}


def test_past_the_count_bound_the_least_recently_used_program_of_any_cache_is_dropped():
    budget = ProgramBudget(max_programs=3)
    a, b = AotCache("a", _step, budget=budget), AotCache("b", _step, budget=budget)
    a.prepare("t", *_args(4), scale=1.0)
    b.prepare("t", *_args(8), scale=1.0)
    a.prepare("t", *_args(16), scale=1.0)
    a.prepare("t", *_args(4), scale=1.0)  # used again: the most recent now, so (b, 8) is the oldest
    a.prepare("t", *_args(32), scale=1.0)
    assert _held(a) == {4, 16, 32} and _held(b) == set()  # dropped from the other cache: one budget for all
    s = budget.stats()
    assert (s.held, s.compiles, s.evictions, s.recompiles) == (3, 4, 1, 0)
    assert a.compiles == 3 and a.compiled_count == 3


def test_a_dropped_program_compiles_again_and_gives_the_same_results():
    budget = ProgramBudget(max_programs=1)
    cache = AotCache("t", _step, donate=("acc",), budget=budget)
    first = cache("t", *_args(4), scale=3.0)
    cache("t", *_args(8), scale=3.0)  # drops the 4-row program
    assert _held(cache) == {8}
    before = persistent_cache.counts().requests
    again = cache("t", *_args(4), scale=3.0)
    assert persistent_cache.counts().requests - before == 1  # built again (compiled, or read back from disk)
    for x, y in zip(first, again):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    s = budget.stats()
    assert (s.compiles, s.evictions, s.recompiles) == (3, 2, 1) and cache.compiles == 3
    assert s.compile_seconds > 0


def test_the_byte_bound_drops_programs_but_never_the_one_just_built(monkeypatch):
    # On CPU every program weighs UNKNOWN_PROGRAM_BYTES (no code size reported): weigh them by hand instead.
    monkeypatch.setattr(aot_cache, "program_bytes", lambda stats: 3)
    budget = ProgramBudget(max_programs=100, max_bytes=7)
    cache = AotCache("t", _step, budget=budget)
    for rows in (4, 8, 16):
        cache.prepare("t", *_args(rows), scale=1.0)
    assert _held(cache) == {8, 16} and budget.stats().held_bytes == 6
    budget.configure(max_programs=100, max_bytes=2)  # below one program: all dropped, none is about to run
    assert _held(cache) == set()
    cache.prepare("t", *_args(32), scale=1.0)  # over the bound alone, and kept: it is about to run
    assert _held(cache) == {32} and budget.stats().evictions == 3


def test_a_program_weighs_its_code_size_or_a_fixed_estimate_where_the_backend_reports_none():
    assert program_bytes(None) == UNKNOWN_PROGRAM_BYTES
    executable = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile()
    assert program_bytes(executable.memory_analysis()) > 0  # CPU reports 0 bytes of code: the estimate


def test_a_dropped_programs_memory_need_is_kept_and_a_collected_cache_leaves_the_budget():
    budget = ProgramBudget(max_programs=1)
    cache = AotCache("t", _step, donate=("acc",), budget=budget)
    needed = cache.needed_bytes("t", *_args(64), scale=1.0)
    cache.prepare("t", *_args(4), scale=1.0)  # drops the 64-row program
    assert cache.needed_bytes("t", *_args(64), scale=1.0) == needed and cache.compiles == 2  # nothing rebuilt
    del cache
    gc.collect()
    assert budget.stats().held == 0 and budget.stats().evictions == 1
