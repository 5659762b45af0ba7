"""Accelerator metrics of the JAX worker (docs/metrics.md): device memory, model FLOPs and an MFU estimate per batch
kind.

Updated after every engine call (`AcceleratorMeter.observe`, a few cheap calls), exported on the worker's /metrics.

**Device memory**: `jax.local_devices()[i].memory_stats()` where the backend reports it (GPU and TPU do); JAX's CPU
backend answers None (jax 0.10.2 here), so a CPU worker exports no memory series at all rather than zeros.

**Model FLOPs per token** (from the model's config; N = the weights one token's forward pass multiplies through):
    N = L x (attention projections q, k, v, o: H·(nh·hd) + 2·H·(nkv·hd) + (nh·hd)·H
             + MLP: dense 3·H·I, or MoE k·3·H·I_moe + the router H·E)
        + unembedding H·V                         (embedding lookups are not matmuls: not counted)
    forward and sampling:   2·N per token
    forward_backward:       6·N per token (forward 2N + backward 4N, the usual training convention. A LoRA step
                            computes no gradient for the base weights, so the work really done is nearer 4N:
                            read forward_backward MFU as comparable with other trainers' figures, not as a bound)
The attention scores and values (4·L·nh·hd·context per token) are left out: they depend on each sequence's length and
are small at the lengths this service trains. Sampling counts generated tokens only (prefill is not in the count),
so its MFU is an underestimate. A `forward` op batched into a forward_backward engine call counts as 6·N too (the
kind is the engine call's).

**MFU** = FLOPs of the engine call / its wall time / peak, where peak = per-device peak x the devices the call runs
on: `--peak-tflops` when given, else the device's bf16 dense peak from PEAK_TFLOPS below, else (CPU, an unknown
device) NOMINAL_TFLOPS, so that MFU is never 0 by lack of a peak but is only indicative there.
"""

from __future__ import annotations

import logging
from typing import Any

from tinkerflow.common import metrics
from tinkerflow.workers.engine.model.families import ModelConfig, family_named

log = logging.getLogger(__name__)

# bf16 dense (no sparsity) TFLOP/s per device, from the vendors' datasheets: NVIDIA H100 SXM 989 (PCIe 756), H200
# 989, A100 312 (NVIDIA H100/H200/A100 datasheets); Google Cloud TPU v6e 918, v5p 459, v5e 197, v4 275 (Cloud TPU
# system architecture pages). Matched against `device.device_kind` (e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"),
# lower-cased, first match wins: the more specific names come first.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h100", "pcie"), 756.0),
    (("h100",), 989.0),
    (("h200",), 989.0),
    (("a100",), 312.0),
    (("v6 lite",), 918.0),
    (("v6e",), 918.0),
    (("v5 lite",), 197.0),
    (("v5e",), 197.0),
    (("v5p",), 459.0),
    (("tpu v5",), 459.0),
    (("tpu v4",), 275.0),
)
# A CPU device (or one not in the table): a nominal 0.1 TFLOP/s, the order of a few cores' fp32 FMA throughput.
NOMINAL_TFLOPS = 0.1
FLOPS_PER_PARAM = {"forward_backward": 6, "sample": 2, "forward": 2}


def params_per_token(c: ModelConfig) -> int:
    """N above: the weights a token's forward pass multiplies through (active experts only for MoE), as the model's
    family counts them (model/layer_costs.py)."""
    return family_named(c.arch).matmul_params(c)


def peak_tflops_of(device_kind: str, override: float = 0.0) -> tuple[float, str]:
    """Per-device peak TFLOP/s and where it came from ("--peak-tflops", the table, or "nominal")."""
    if override > 0:
        return override, "--peak-tflops"
    kind = device_kind.lower()
    for words, tflops in PEAK_TFLOPS:
        if all(w in kind for w in words):
            return tflops, f"table ({device_kind})"
    return NOMINAL_TFLOPS, f"nominal ({device_kind or 'unknown device'})"


class AcceleratorMeter:
    def __init__(self, config: ModelConfig | None, peak_tflops: float = 0.0, devices: list[Any] | None = None):
        import jax

        # jax's device API is partly untyped: activities/ is type-checked strictly, so its results are annotated here
        self.devices: list[Any] = list(devices if devices is not None else jax.local_devices())  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]
        # a step spans every process
        self.n_devices: int = len(devices) if devices is not None else jax.device_count()  # pyright: ignore[reportUnknownMemberType]
        kind = self.devices[0].device_kind if self.devices else ""
        per_device, source = peak_tflops_of(kind, peak_tflops)
        self.peak_flops = per_device * 1e12 * max(self.n_devices, 1)
        self.params = params_per_token(config) if config is not None else 0
        log.info(
            "MFU estimate: %s parameters per token, peak %.4g TFLOP/s per device x %d (%s)",
            f"{self.params:,}",
            per_device,
            self.n_devices,
            source,
        )

    def flops(self, kind: str, tokens: int) -> float:
        return float(FLOPS_PER_PARAM.get(kind, 0) * self.params * tokens)

    def observe(self, kind: str, tokens: int, seconds: float) -> None:
        """After an engine call of `kind` that processed `tokens` in `seconds`: FLOPs, MFU, device memory."""
        flops = self.flops(kind, tokens)
        if flops > 0 and seconds > 0:
            metrics.ENGINE_FLOPS.labels(kind).inc(flops)
            metrics.ENGINE_MFU.labels(kind).set(flops / seconds / self.peak_flops)
        self.observe_memory()

    def observe_memory(self) -> None:
        for d in self.devices:
            try:
                stats = d.memory_stats()
            except Exception:  # a backend without the call; nothing to export for it
                stats = None
            if not stats:
                continue
            label = f"{d.platform}:{d.id}"
            if "bytes_in_use" in stats:
                metrics.DEVICE_MEMORY_IN_USE.labels(label).set(stats["bytes_in_use"])
            if "peak_bytes_in_use" in stats:
                metrics.DEVICE_MEMORY_PEAK.labels(label).set(stats["peak_bytes_in_use"])
            if "bytes_limit" in stats:
                metrics.DEVICE_MEMORY_LIMIT.labels(label).set(stats["bytes_limit"])


def publish_memory_plan(plan: Any) -> None:
    """The engine's device-memory plan (runtime/memory_plan.MemoryPlan) as gauges, once at load."""
    parts = {
        "capacity": plan.capacity_bytes,
        "resident": plan.resident_bytes,
        "snapshots": plan.snapshot_bytes,
        "reserve": plan.reserve_bytes,
        "prefix_cache": plan.prefix_cache_bytes,
        "work": plan.work_bytes,
    }
    for part, value in parts.items():
        metrics.MEMORY_PLAN_BYTES.labels(part).set(value)
    metrics.MEMORY_PLAN_MAX_TOKENS.labels("forward_backward").set(plan.max_train_tokens)
    metrics.MEMORY_PLAN_MAX_TOKENS.labels("sample").set(plan.max_sample_tokens)
    metrics.MEMORY_PLAN_BYTES_PER_TOKEN.labels("train").set(plan.train_bytes_per_token)
    metrics.MEMORY_PLAN_BYTES_PER_TOKEN.labels("kv").set(plan.kv_bytes_per_token)
