"""The engine alone on one accelerator, in one run of a few minutes: what a first GPU (or TPU) session should learn.

    python -m benchmarks.device_check [--budget-s 480] [--phases env,parity,...] [--out FILE] [--smoke]

Phases in priority order, each printing one JSON line per figure (and one `{"phase": ..., "error": ...}` line when it
fails: a failure on real hardware is a finding, and the next phase still runs); a phase whose estimated time no
longer fits the budget is skipped and says so:

* env: versions, the device, a bf16 matmul's TFLOP/s and a device-to-device copy's GB/s (the measured peaks).
* parity: bf16 against float32 weights (one random model, same draws), whether float32 matmuls run as TF32, GPU
  against CPU in float32, and every attention implementation against the reference with gradients.
* attention: each attention implementation's forward+backward at 8K and 32K tokens, Qwen3-8B's heads.
* train: Qwen3-8B shape (random weights drawn on the device), bf16, 8 adapters of rank 32, gradient checkpointing,
  8 datums x 1,024 tokens: one adapter against eight; tokens/s and MFU over the datasheet and the measured peak.
* long: the same model's forward_backward of one datum of 8K, 16K and 32K tokens: time, peak memory, and the
  memory plan's estimate beside it (the plan's admission limit is lifted here to measure past it).
* sample: decode ms per step at 64 and 256 rows (1 and 8 adapters at 256) against the HBM floor (weights and the
  KV read per step over the measured copy bandwidth).
* agree: the sampler's logprobs of its own tokens against the trainer's forward logprobs of the same sequence.

The 8B phases share one worker process (one model draw); every other phase runs in its own. A worker that dies is
restarted on the phases left after the one it died in. `--smoke` runs every phase on tiny shapes on CPU (CI runs
it). The machine needs only what the engine imports (jax, flax, optax, numpy, safetensors): this script puts the
repository's folders on the import path under the `tinkerflow` name when the package is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("env", "parity", "attention", "train", "long", "sample", "agree")
MODEL_PHASES = ("train", "long", "sample", "agree")  # share one worker and one model
# Seconds each phase needs at least on an H100 (compiles included); a phase is skipped when less is left.
ESTIMATE_S: dict[str, float] = {
    "env": 20, "parity": 45, "attention": 45, "train": 100, "long": 120, "sample": 90, "agree": 40,
}  # fmt: skip
SMOKE_ESTIMATE_S: dict[str, float] = dict.fromkeys(PHASES, 5)

QWEN3_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0)  # fmt: skip
QWEN3_06B_2L = {**QWEN3_8B, "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
                "intermediate_size": 3072, "tie_word_embeddings": True}  # fmt: skip
TINY = {**QWEN3_8B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 4096}  # fmt: skip
# Dense bf16 datasheet peaks (FLOP/s) by device kind (substring).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v6": 918e12, "TPU v4": 275e12}  # fmt: skip


def ensure_importable() -> None:
    """`tinkerflow.*` from this checkout when the package is not installed (a bare device machine): a folder of
    links named as pyproject.toml's package-dir maps them."""
    try:
        import tinkerflow.workers.engine.engine  # noqa: F401

        return
    except ImportError:
        pass
    shim = Path(tempfile.gettempdir()) / "tinkerflow-device-check" / "tinkerflow"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").touch()
    for name, target in {"common": "platform/common", "workers": "workers", "workflows": "workflows"}.items():
        link = shim / name
        if not link.exists():
            link.symlink_to(REPO / target)
    sys.path.insert(0, str(shim.parent))
    for mod in [m for m in sys.modules if m == "tinkerflow" or m.startswith("tinkerflow.")]:
        del sys.modules[mod]


def emit(out: list | None = None, **figure) -> None:
    line = json.dumps(figure, default=str)
    print(line, flush=True)
    if out is not None:
        out.append(line)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ------------------------------------------------------------------------------------------------ the phases


def timed(fn, repeats: int) -> list[float]:
    import jax

    jax.block_until_ready(fn())  # compile and warm
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def phase_env(smoke: bool) -> None:
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    emit(phase="env", figure="env", jax=jax.__version__, flax=flax.__version__, numpy=np.__version__,
         python=sys.version.split()[0], backend=jax.default_backend(), device=dev.device_kind,
         devices=jax.device_count(),
         memory_limit_gib=round(stats["bytes_limit"] / 2**30, 1) if stats else None)  # fmt: skip
    n = 512 if smoke else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    s = min(timed(lambda: mm(a), 3 if smoke else 10))
    emit(phase="env", figure="bf16_matmul_tflops", n=n, tflops=round(2 * n**3 / s / 1e12, 1), seconds=s)
    size = (2**20 if smoke else 2**30) // 4  # float32 elements: 4 MiB / 4 GiB
    x = jnp.ones((size,), jnp.float32)
    cp = jax.jit(lambda x: x + 1)
    s = min(timed(lambda: cp(x), 3 if smoke else 10))
    emit(phase="env", figure="hbm_copy_gb_per_s", gib=round(size * 4 / 2**30, 3),
         gb_per_s=round(2 * size * 4 / s / 1e9, 1), convention="bytes read + written")  # fmt: skip


def _logprobs(engine, tokens):
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput

    req = ForwardBackwardInput(slot=0, data=[Datum(tokens[:-1], {"target_tokens": tokens[1:]})],
                               loss_fn="cross_entropy", forward_only=True)  # fmt: skip
    [res] = engine.forward_backward([req])
    return res.outputs[0]["logprobs"]


def phase_parity(smoke: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.runtime.sharding import MeshConfig
    from tinkerflow.workers.engine.types import LoraConfig

    # float32 matmul: TF32 or true float32? (relative error against float64 on the host)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(256, 256)).astype(np.float32), rng.normal(size=(256, 256)).astype(np.float32)
    got = np.asarray(jax.jit(jnp.matmul)(a, b), np.float64)
    rel = float(np.max(np.abs(got - a.astype(np.float64) @ b)) / np.max(np.abs(a.astype(np.float64) @ b)))
    emit(phase="parity", figure="float32_matmul", rel_err=rel, looks_like="tf32" if rel > 1e-4 else "float32",
         default_matmul_precision=str(jax.config.values.get("jax_default_matmul_precision")))  # fmt: skip

    cfg = TINY if smoke else QWEN3_06B_2L
    tokens = rng.integers(1, cfg["vocab_size"], 257 if not smoke else 65).astype(np.int32)
    out = {}
    for name, dtype, devices in (("f32", "float32", None), ("bf16", "bfloat16", None), ("cpu_f32", "float32", "cpu")):
        mesh = MeshConfig(fsdp=1, tp=1).build(jax.devices("cpu")) if devices == "cpu" else None
        engine = Engine.random(cfg, max_lora_adapters=1, max_lora_rank=8, seed=1, dtype=dtype, mesh=mesh)
        engine.create_adapter(0, LoraConfig(rank=8, seed=0))
        out[name] = _logprobs(engine, tokens)
        del engine
    for pair in (("bf16", "f32"), ("f32", "cpu_f32")):
        d = np.abs(out[pair[0]] - out[pair[1]])
        emit(phase="parity", figure=f"logprobs_{pair[0]}_vs_{pair[1]}", max_abs=float(d.max()),
             mean_abs=float(d.mean()), tokens=len(tokens) - 1,
             shape="tiny" if smoke else "qwen3-0.6b x 2 layers")  # fmt: skip
    _attention_parity(smoke)


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


def _attention_parity(smoke: bool) -> None:
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
                    errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                                  / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-9))
                            for a, b in zip(grads, ref_grads)]  # fmt: skip
                    emit(phase="parity", figure="attention_vs_reference", impl=impl, dtype=jnp.dtype(dtype).name,
                         packed=packed, tokens=t, loss_rel_err=float(abs(val - ref_val) / (abs(ref_val) + 1e-9)),
                         grad_rel_err_qkv=[round(e, 7) for e in errs])  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a kernel that fails here is a finding, not a stop
                    emit(phase="parity", figure="attention_vs_reference", impl=impl, dtype=jnp.dtype(dtype).name,
                         packed=packed, error=f"{type(e).__name__}: {str(e)[:300]}")  # fmt: skip
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
                    flops = 4 * t * t / 2 * heads * d * 3.5  # causal forward (QK, PV) + backward (2.5x)
                    emit(phase="attention", figure="attention_fwd_bwd", impl=impl, tokens=t, packed=packed,
                         ms=round(min(s) * 1000, 2), tflops=round(flops / min(s) / 1e12, 1))  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    emit(phase="attention", figure="attention_fwd_bwd", impl=impl, tokens=t, packed=packed,
                         error=f"{type(e).__name__}: {str(e)[:300]}")  # fmt: skip
    del jax


def profile_top(label: str, fn, top: int = 15) -> None:
    """Run fn once under jax's profiler and emit where the device's time went: the `top` kernels (or host ops on
    CPU) by total time, with counts and the total."""
    import collections
    import glob
    import gzip

    import jax

    directory = tempfile.mkdtemp(prefix="device-check-profile-")
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    files = glob.glob(f"{directory}/**/*perfetto_trace.json.gz", recursive=True)
    if not files:
        emit(phase="profile", label=label, error="no perfetto trace written")
        return
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = [pid for pid, name in procs.items() if "device" in name.lower() or "gpu" in name.lower()]
    keep = set(device) or set(procs)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in keep:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    emit(
        phase="profile",
        label=label,
        where="device" if device else "host",
        total_ms=round(sum(total.values()) / 1e3, 2),
        events=sum(count.values()),
        top=[[name[:90], round(us / 1e3, 3), count[name]] for name, us in total.most_common(top)],
    )


def matmul_params(cfg: dict) -> int:
    """Base matmul parameters per token, as the model's family counts them for the worker's MFU."""
    from tinkerflow.activities.accelerator_metrics import params_per_token
    from tinkerflow.workers.engine.model.families import ModelConfig

    return params_per_token(ModelConfig.from_hf(cfg))


def _peak(kind: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


class ModelPhases:
    """train, long, sample and agree on one engine: Qwen3-8B's shape (tiny with --smoke), random weights, bf16 on
    accelerators, 8 adapter slots of rank 32."""

    def __init__(self, smoke: bool, budget: Budget, quick: bool = False):
        import jax

        from tinkerflow.workers.engine.engine import Engine
        from tinkerflow.workers.engine.types import LoraConfig

        self.smoke, self.budget, self.quick = smoke, budget, quick
        self.cfg = TINY if smoke else QWEN3_8B
        self.vocab = int(self.cfg["vocab_size"])  # pyright: ignore[reportArgumentType]
        t0 = time.perf_counter()
        self.engine = Engine.random(self.cfg, max_lora_adapters=8, max_lora_rank=32, seed=0,
                                    gradient_checkpointing=True, snapshot_budget_bytes=4 * 2**30)  # fmt: skip
        jax.block_until_ready(self.engine._base)
        for slot in range(8):
            self.engine.create_adapter(slot, LoraConfig(rank=32, seed=slot))
        emit(phase="model", figure="model", shape="tiny" if smoke else "qwen3-8b", dtype=str(self.engine.dtype),
             init_s=round(time.perf_counter() - t0, 1), memory_plan=self.engine.memory.as_metrics(),
             device_memory_in_use_gib=self._mem("bytes_in_use"))  # fmt: skip
        self.kind = jax.devices()[0].device_kind

    def forget_programs(self) -> None:
        """Drop compiled programs, so the next call compiles under the environment as it is now."""
        steps, sampler = self.engine._steps, self.engine.sampler
        for cache in (steps.grad_step, steps.forward_step, *sampler.caches()):
            cache.clear()

    def _mem(self, key: str) -> float | None:
        import jax

        dev = jax.devices()[0]
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        return round(stats[key] / 2**30, 2) if stats and key in stats else None

    def _data(self, n: int, rows: int, seed: int):
        import numpy as np

        from tinkerflow.workers.engine.types import Datum

        rng = np.random.default_rng(seed)
        out = []
        for _ in range(rows):
            toks = rng.integers(1, self.vocab, n + 1).astype(np.int32)
            out.append(Datum(toks[:-1], {"target_tokens": toks[1:]}))
        return out

    def _fb_seconds(self, requests, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats + 1):  # the first compiles
            t0 = time.perf_counter()
            results = self.engine.forward_backward(requests)
            bad = [r for r in results if not hasattr(r, "metrics")]
            if bad:
                raise RuntimeError(f"forward_backward refused: {bad[0]}")
            out.append(time.perf_counter() - t0)
        return out

    def train(self) -> None:
        from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput

        n, rows = (64, 8) if self.smoke else (1024, 8)
        self.engine._steps.pack_tokens = n  # one datum per row in both layouts: the comparison is the adapters'
        data = self._data(n, rows, 0)
        short = self._data(n // 8, rows * 8, 1)  # 8 datums of n/8 tokens per adapter: packed 8 to a row
        layouts = {
            "1_adapter": [ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy")],
            "8_adapters": [ForwardBackwardInput(slot=i, data=[d], loss_fn="cross_entropy") for i, d in enumerate(data)],
            "8_adapters_packed": [
                ForwardBackwardInput(slot=i, data=short[8 * i : 8 * i + 8], loss_fn="cross_entropy") for i in range(8)
            ],
        }
        if self.quick:
            layouts = {"8_adapters": layouts["8_adapters"]}
        peak, flops_per_token = _peak(self.kind), 6 * matmul_params(self.cfg)
        tps = {}
        for name, requests in layouts.items():
            s = self._fb_seconds(requests, 2 if self.smoke else 3)
            tps[name] = n * rows / min(s[1:])
            t0 = time.perf_counter()
            for slot in {r.slot for r in requests}:
                self.engine.optim_step(slot, AdamConfig(learning_rate=1e-5))
            emit(phase="train", figure="train_tokens_per_s", layout=name, rows=rows, tokens_per_row=n,
                 datums=sum(len(r.data) for r in requests),
                 first_s=round(s[0], 2), step_s=round(min(s[1:]), 3), tokens_per_s=round(tps[name]),
                 mfu_datasheet=round(flops_per_token * tps[name] / peak, 3) if peak else None,
                 optim_s=round(time.perf_counter() - t0, 3), gradient_checkpointing=True,
                 flops_convention="6 * N_base_matmul_params per token")  # fmt: skip
        if "1_adapter" in tps:
            emit(phase="train", figure="eight_adapters_cost", ratio=round(tps["1_adapter"] / tps["8_adapters"], 3),
                 target="<= 1.15")  # fmt: skip
        profile_top(
            "train step, 8 adapters x 1,024 tokens", lambda: self.engine.forward_backward(layouts["8_adapters"])
        )

    def long(self) -> None:
        import dataclasses

        from tinkerflow.workers.engine.types import ForwardBackwardInput

        plan = self.engine.memory
        self.engine.memory = dataclasses.replace(plan, max_train_tokens=10**9)  # measure past the plan's limit
        self.engine._steps.pack_tokens = 4096
        for n in (1024, 2048, 4096) if self.smoke else (8192, 16384, 32768):
            if self.budget.left() < (5 if self.smoke else 45):
                emit(phase="long", figure="long_forward_backward", tokens=n, skipped="budget")
                continue
            request = [ForwardBackwardInput(slot=0, data=self._data(n, 1, n), loss_fn="cross_entropy")]
            try:
                s = self._fb_seconds(request, 1)
                emit(phase="long", figure="long_forward_backward", tokens=n, first_s=round(s[0], 2),
                     step_s=round(s[-1], 3), tokens_per_s=round(n / s[-1]), peak_gib=self._mem("peak_bytes_in_use"),
                     plan_estimate_gib=round((plan.resident_bytes + plan.train_fixed_bytes
                                              + n * plan.train_bytes_per_token) / 2**30, 2),
                     plan_max_train_tokens=plan.max_train_tokens)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - an out-of-memory here is a figure
                emit(
                    phase="long",
                    figure="long_forward_backward",
                    tokens=n,
                    error=f"{type(e).__name__}: {str(e)[:400]}",
                    plan_max_train_tokens=plan.max_train_tokens,
                )
        self.engine.memory = plan

    def sample(self) -> None:
        import numpy as np

        from tinkerflow.workers.engine.types import SampleInput

        for slot in range(8):
            self.engine.snapshot(slot, f"s{slot}")
        prompt_len = 64
        rng = np.random.default_rng(1)
        prompt = rng.integers(1, self.vocab, prompt_len).astype(np.int32)
        kv_token = self.engine.memory.kv_bytes_per_token
        weights = sum(x.nbytes for x in __import__("jax").tree.leaves(self.engine._base))
        shapes = ((8, 1), (64, 1), (256, 1), (256, 8)) if self.smoke else ((64, 1), (256, 1), (256, 8))
        for rows, adapters in [(256, 1)] if self.quick else shapes:
            if self.budget.left() < (3 if self.smoke else 30):
                emit(phase="sample", figure="decode_ms_per_step", rows=rows, adapters=adapters, skipped="budget")
                continue

            def call(max_tokens: int, rows=rows, adapters=adapters):
                reqs = [SampleInput(prompt=prompt, max_tokens=max_tokens, seed=i, stop_token_ids=[],
                                    snapshot=f"s{i % adapters}") for i in range(rows)]  # fmt: skip
                t0 = time.perf_counter()
                res = self.engine.sample(reqs)
                bad = [r for r in res if not hasattr(r, "sequences")]
                if bad:
                    raise RuntimeError(f"sample refused: {bad[0]}")
                return time.perf_counter() - t0

            try:
                first = call(16)
                short, long_ = min(call(16) for _ in range(2)), min(call(64) for _ in range(2))
                per_step = (long_ - short) / 48
                kv_read = rows * (prompt_len + 40) * kv_token  # the mean filled length over the 48 steps
                emit(phase="sample", figure="decode_ms_per_step", rows=rows, adapters=adapters,
                     ms=round(per_step * 1000, 3), first_call_s=round(first, 2), weights_gib=round(weights / 2**30, 2),
                     kv_read_gib=round(kv_read / 2**30, 3), bytes_per_step=weights + kv_read,
                     tokens_per_s=round(rows / per_step))  # fmt: skip
            except Exception as e:  # noqa: BLE001
                emit(phase="sample", figure="decode_ms_per_step", rows=rows, adapters=adapters,
                     error=f"{type(e).__name__}: {str(e)[:400]}")  # fmt: skip
        if self.budget.left() > (3 if self.smoke else 25):
            reqs = [
                SampleInput(prompt=prompt, max_tokens=64, seed=i, stop_token_ids=[], snapshot="s0") for i in range(256)
            ]
            profile_top("sample, 256 rows x 64 tokens, 1 adapter", lambda: self.engine.sample(reqs))

    def agree(self) -> None:
        import numpy as np

        from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput, SampleInput, SampleResult

        self.engine.forward_backward([ForwardBackwardInput(slot=0, data=self._data(64, 2, 3), loss_fn="cross_entropy")])
        self.engine.optim_step(0, AdamConfig(learning_rate=1e-3))  # LoRA B no longer zero: the adapter matters
        self.engine.snapshot(0, "agree")
        rng = np.random.default_rng(2)
        prompt = rng.integers(1, self.vocab, 40).astype(np.int32)
        [res] = self.engine.sample([SampleInput(prompt=prompt, max_tokens=24, seed=5, stop_token_ids=[],
                                                snapshot="agree")])  # fmt: skip
        assert isinstance(res, SampleResult), res
        seq = res.sequences[0]
        full = np.concatenate([prompt, np.asarray(seq.tokens, np.int32)])
        trainer = _logprobs(self.engine, full)[len(prompt) - 1 :]
        d = np.abs(np.asarray(seq.logprobs) - trainer)
        emit(phase="agree", figure="sampler_vs_trainer_logprobs", max_abs=float(d.max()), mean_abs=float(d.mean()),
             tokens=len(seq.tokens), dtype=str(self.engine.dtype))  # fmt: skip


PHASE_FUNCTIONS = {"env": phase_env, "parity": phase_parity, "attention": phase_attention}


def run_phases(names: list[str], smoke: bool, budget: Budget, quick: bool = False) -> None:
    """The worker: run `names` in order in this process, one `{"phase_done": name}` line after each."""
    ensure_importable()
    model: ModelPhases | None = None
    for name in names:
        t0 = time.perf_counter()
        try:
            if name in MODEL_PHASES:
                model = model or ModelPhases(smoke, budget, quick)
                try:
                    getattr(model, name)()
                except Exception as e:  # noqa: BLE001 - once more on the portable attention, to learn what broke
                    if os.environ.get("TINKERFLOW_ATTENTION") == "blockwise":
                        raise
                    emit(phase=name, error=f"{type(e).__name__}: {str(e)[:600]}",
                         retry="TINKERFLOW_ATTENTION=blockwise", trace=traceback.format_exc()[-1500:])  # fmt: skip
                    os.environ["TINKERFLOW_ATTENTION"] = "blockwise"
                    model.forget_programs()
                    getattr(model, name)()
            else:
                PHASE_FUNCTIONS[name](smoke)
        except Exception as e:  # noqa: BLE001 - reported, and the next phase runs
            emit(phase=name, error=f"{type(e).__name__}: {str(e)[:600]}", trace=traceback.format_exc()[-1500:])
        emit(phase_done=name, seconds=round(time.perf_counter() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting phases after this (seconds)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    parser.add_argument("--smoke", action="store_true", help="every phase on tiny shapes on CPU (CI)")
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    parser.add_argument("--quick", action="store_true", help="train and sample one layout each (a re-check)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    budget = Budget(args.budget_s)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    os.environ.setdefault("TINKERFLOW_SAMPLER_EAGER_BUCKETS", "0")  # compile the slot buckets in use only
    if args.worker:
        run_phases(names, args.smoke, budget, args.quick)
        return 0
    out = args.out.open("w") if args.out else None
    estimate = SMOKE_ESTIMATE_S if args.smoke else ESTIMATE_S
    groups = [[n] for n in names if n not in MODEL_PHASES] + [[n for n in names if n in MODEL_PHASES]]
    for group in (g for g in groups if g):
        todo = list(group)
        while todo:
            fits = [n for n in todo if estimate[n] <= budget.left()]
            for n in todo:
                if n not in fits:
                    relay(out, json.dumps({"phase": n, "skipped": "budget", "left_s": round(budget.left())}))
            todo = fits
            if todo:
                todo = run_worker(todo, args.smoke, budget, out, args.quick)
    if out is not None:
        out.close()
    return 0


def relay(out, line: str) -> None:
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def run_worker(todo: list[str], smoke: bool, budget: Budget, out, quick: bool = False) -> list[str]:
    """Run `todo` in one worker process, relaying its lines as they come (so a run cut short keeps what it
    measured); returns the phases left after the one it died in, if it died."""
    cmd = [sys.executable, "-m", "benchmarks.device_check", "--worker", "--phases", ",".join(todo),
           "--budget-s", str(max(1.0, budget.left() - 10))]  # fmt: skip
    cmd += (["--smoke"] if smoke else []) + (["--quick"] if quick else [])
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read after the process ends, closed with it)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    timer = threading.Timer(max(1.0, budget.left()), proc.kill)
    timer.start()
    done: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "phase_done" in rec:
            done.append(rec["phase_done"])
        relay(out, line.rstrip("\n"))
    proc.wait()
    timer.cancel()
    left = [n for n in todo if n not in done]
    if not left:
        return []
    err.seek(0)
    relay(
        out, json.dumps({"phase": left[0], "error": f"worker exited {proc.returncode}", "stderr": err.read()[-2000:]})
    )
    return left[1:]


if __name__ == "__main__":
    sys.exit(main())
