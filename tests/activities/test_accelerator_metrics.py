"""Accelerator metrics of the JAX worker (activities/accelerator_metrics.py): the FLOPs model against the checkpoint's
own weight shapes, the peak table, MFU from hand-computed figures, and device memory where JAX reports it."""

from __future__ import annotations

import math

import jax
import pytest
from prometheus_client import REGISTRY

from tinkerflow.activities.accelerator_metrics import NOMINAL_TFLOPS, AcceleratorMeter, params_per_token, peak_tflops_of
from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.families.qwen3.tiny import config_dict, parameter_shapes
from tinkerflow.workers.engine.model.families.qwen3_moe.tiny import MOE_SHAPE, moe_config_dict, moe_parameter_shapes
from tinkerflow.workers.engine.model.tiny_shapes import SHAPE


def _reference_params(shapes: list[tuple[str, tuple[int, ...]]], active_fraction: float = 1.0) -> float:
    """Matmul weights a token meets, counted from the checkpoint's tensor list: every 2-D weight but the embedding
    (a lookup), experts scaled by the fraction of them a token is routed to, and the unembedding even when tied."""
    total = 0.0
    for name, shape in shapes:
        if len(shape) != 2 or "embed_tokens" in name:
            continue
        total += math.prod(shape) * (active_fraction if ".experts." in name else 1.0)
    if not any(name == "lm_head.weight" for name, _ in shapes):
        total += SHAPE["hidden_size"] * SHAPE["vocab_size"]
    return total


def test_params_per_token_of_the_tiny_dense_model_match_its_weights():
    config = ModelConfig.from_hf(config_dict(eos_token_id=0))
    assert params_per_token(config) == _reference_params(parameter_shapes())


def test_params_per_token_of_the_tiny_moe_count_only_the_routed_experts():
    config = ModelConfig.from_hf(moe_config_dict(config_dict(eos_token_id=0)))
    active = MOE_SHAPE["num_experts_per_tok"] / MOE_SHAPE["num_experts"]
    assert params_per_token(config) == _reference_params(moe_parameter_shapes(), active)


@pytest.mark.parametrize(
    ("kind", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("TPU v5 lite", 197.0),
        ("TPU v6 lite", 918.0),
        ("TPU v5p", 459.0),
        ("cpu", NOMINAL_TFLOPS),
    ],
)
def test_peak_by_device_kind(kind, tflops):
    assert peak_tflops_of(kind)[0] == tflops
    assert peak_tflops_of(kind, override=123.0) == (123.0, "--peak-tflops")


class _Device:
    platform, id, device_kind = "gpu", 7, "NVIDIA H100 80GB HBM3"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_mfu_and_flops_from_hand_computed_figures_and_memory_from_memory_stats():
    config = ModelConfig.from_hf(config_dict(eos_token_id=0))
    stats = {"bytes_in_use": 1000, "peak_bytes_in_use": 5000, "bytes_limit": 80_000}
    meter = AcceleratorMeter(config, devices=[_Device(stats)])
    n = params_per_token(config)
    before = _value("tinkerflow_engine_flops_total", kind="forward_backward") or 0.0
    meter.observe("forward_backward", tokens=1000, seconds=0.5)
    # 6·N per trained token; one H100 at 989 TFLOP/s bf16 dense
    assert (_value("tinkerflow_engine_flops_total", kind="forward_backward") or 0.0) - before == 6 * n * 1000
    assert _value("tinkerflow_engine_mfu", kind="forward_backward") == pytest.approx(6 * n * 1000 / 0.5 / 989e12)
    meter.observe("sample", tokens=10, seconds=2.0)
    assert _value("tinkerflow_engine_mfu", kind="sample") == pytest.approx(2 * n * 10 / 2.0 / 989e12)
    assert _value("tinkerflow_device_memory_in_use_bytes", device="gpu:7") == 1000
    assert _value("tinkerflow_device_memory_peak_bytes", device="gpu:7") == 5000
    assert _value("tinkerflow_device_memory_limit_bytes", device="gpu:7") == 80_000


def test_a_backend_without_memory_stats_exports_no_memory_series():
    AcceleratorMeter(None, devices=[type("Cpu", (_Device,), {"platform": "cpu", "id": 99})(None)]).observe_memory()
    assert _value("tinkerflow_device_memory_in_use_bytes", device="cpu:99") is None


def test_device_memory_of_this_machines_jax_backend():
    device = jax.local_devices()[0]
    if not device.memory_stats():
        pytest.skip(f"JAX's {device.platform} backend reports no memory_stats() (None): no device memory series")
    AcceleratorMeter(None).observe_memory()
    in_use = _value("tinkerflow_device_memory_in_use_bytes", device=f"{device.platform}:{device.id}")
    assert in_use is not None and in_use > 0
