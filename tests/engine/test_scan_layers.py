"""Stacked, scanned decoder layers (decoder.DecoderStack): the train step's program does not grow with depth, and
the scanned model computes what the per-layer loop computes (logprobs, gradients, optimizer steps, samples, exports).

Counted, not timed: the number of StableHLO operations of the lowered train step for a 2-layer and an 8-layer model.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import jax
import numpy as np
import pytest
from conftest import MAX_ADAPTERS, MAX_RANK
from flax import nnx
from small_qwen3 import qwen3_config

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.decoder import CausalLM
from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.sharding import DeviceLayout, MeshConfig, as_mesh
from tinkerflow.workers.engine.training.steps import StepFunctions, pack
from tinkerflow.workers.engine.types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    LoraConfig,
    SampleInput,
)


def _config(layers: int) -> ModelConfig:
    return qwen3_config(layers)


def _op_count(layers: int, *, scan: bool, remat: bool) -> int:
    """StableHLO operations in the lowered forward+backward train step (abstract shapes: nothing is computed)."""
    config = _config(layers)
    model = nnx.eval_shape(
        lambda: CausalLM(config, max_adapters=2, max_rank=4, rngs=nnx.Rngs(0), remat=remat, scan_layers=scan)
    )
    assert model.scan_layers is scan
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, nnx.Param)
    steps = StepFunctions(graphdef, DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), config))
    b, t = 2, 16

    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pack([], [], b, t, 1))
    as_spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    text = (
        jax.jit(partial(steps.grad_step._fn, remat=remat))
        .lower(as_spec(lora), as_spec(base), as_spec(lora), batch)
        .as_text()
    )
    return len(re.findall(r"= (?:stablehlo|chlo|mhlo)\.\w+", text))


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_train_step_program_does_not_grow_with_depth(remat):
    scanned = {n: _op_count(n, scan=True, remat=remat) for n in (2, 8)}
    assert scanned[2] == scanned[8], scanned  # one layer body whatever the depth
    loop = {n: _op_count(n, scan=False, remat=remat) for n in (2, 8)}
    # The counter does see layers: the per-layer loop's program grows with every layer it unrolls.
    assert loop[8] - loop[2] > 3 * (loop[2] - scanned[2] // 2), (loop, scanned)
    assert scanned[8] < loop[8] / 2, (scanned, loop)


# ---------------------------------------------------------------------------------------- scan == loop, end to end

# Scan and loop run the same operations per layer in the same order; only XLA's fusion around them may differ, so
# results agree to float32 rounding: these tolerances are that rounding, not model error.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def engines(qwen3_dir) -> dict[bool, Engine]:
    return {
        scan: Engine.load(
            str(qwen3_dir), max_lora_adapters=MAX_ADAPTERS, max_lora_rank=MAX_RANK, progress=False, scan_layers=scan
        )
        for scan in (True, False)
    }


def _datums(rng: np.random.Generator, n: int) -> list[Datum]:
    out = []
    for length in rng.integers(6, 20, size=n):
        seq = rng.integers(1, 300, size=int(length) + 1)
        w = rng.uniform(0.5, 1.5, size=int(length)).astype(np.float32)
        out.append(Datum(tokens=seq[:-1], inputs={"target_tokens": seq[1:], "weights": w}))
    return out


def _close(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=RTOL, atol=ATOL, err_msg=f"{what} {k}")


def _same_adapter(engines: dict[bool, Engine], slot: int) -> None:
    """The same adapter in both engines: names do not depend on the layout (layers.{i}.…), so the scanned
    engine's draw is copied into the loop engine by name."""
    scan, loop = engines[True], engines[False]
    for e in (scan, loop):
        e.create_adapter(slot, LoraConfig(rank=4, seed=3, train_unembed=True))
    weights = scan.adapter_weights(slot)
    assert "layers.1.self_attn.q_proj.lora_a" in weights and weights["layers.1.mlp.down_proj.lora_b"].shape == (4, 64)
    loop.set_adapter_weights(slot, weights)
    _close(scan.adapter_weights(slot), loop.adapter_weights(slot), "weights")


def test_scanned_and_looped_training_agree(engines):
    """Forward/backward outputs, accumulated gradients, AdamW moments and weights after a step; exports import
    across layouts."""
    scan, loop = engines[True], engines[False]
    assert scan._graphdef != loop._graphdef
    _same_adapter(engines, 1)
    data = _datums(np.random.default_rng(0), 3)
    request = ForwardBackwardInput(slot=1, data=data, loss_fn="cross_entropy")
    results = [e.forward_backward([request])[0] for e in (scan, loop)]
    for a, b in zip(results[0].outputs, results[1].outputs, strict=True):
        _close(a, b, "outputs")
    _close(scan.accumulated_grads(1), loop.accumulated_grads(1), "grads")
    metrics = [e.optim_step(1, AdamConfig(learning_rate=1e-2)) for e in (scan, loop)]
    assert metrics[0]["step"] == metrics[1]["step"] == 1
    exported = [e.export_slot(1) for e in (scan, loop)]
    for what in ("weights", "mu", "nu"):
        _close(getattr(exported[0], what), getattr(exported[1], what), what)
    loop.import_slot(2, exported[0], optimizer=True)  # a scanned engine's export into the loop layout
    _close(loop.adapter_weights(2), exported[0].weights, "imported")


@pytest.mark.slow
def test_scanned_and_looped_sampling_agree(engines):
    """Prefill and decode over the stacked KV cache give the loop's tokens and log-probs, with an adapter and
    without (sampler logprobs == trainer logprobs on the scanned model is test_sampler's, in the default run)."""
    scan, loop = engines[True], engines[False]
    _same_adapter(engines, 3)
    for e in (scan, loop):
        e.snapshot(3, "trained")
    prompt = np.random.default_rng(1).integers(1, 300, size=9)
    samples = [
        e.sample(
            [
                SampleInput(
                    prompt=prompt,
                    num_samples=2,
                    max_tokens=12,
                    seed=7,
                    stop_token_ids=[],
                    include_prompt_logprobs=True,
                    snapshot=key,
                )
                for key in ("trained", None)
            ]
        )
        for e in (scan, loop)
    ]
    for a, b in zip(samples[0], samples[1], strict=True):
        assert not isinstance(a, Exception) and not isinstance(b, Exception)
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=RTOL, atol=1e-5)
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        np.testing.assert_allclose(
            np.asarray(a.prompt_logprobs[1:]), np.asarray(b.prompt_logprobs[1:]), rtol=RTOL, atol=1e-5
        )


def test_a_checkpoint_missing_one_layers_tensor_is_refused_naming_it(qwen3_dir, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from tinkerflow.workers.engine.model.loader import load_model

    directory = tmp_path / "partial"
    shutil.copytree(qwen3_dir, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks layers\.self_attn\.q_proj\.kernel of layers \[1\]"):
        load_model(str(directory), max_adapters=1, max_rank=1, progress=False)
