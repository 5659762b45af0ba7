"""A LoRA trained on the tiny Qwen3.5 vision-language model with an image datum, exported by the engine and merged
by tinker-cookbook's `build_hf_model` (what `weights.download` → merge runs) into the VL checkpoint, loads as
transformers' `Qwen3_5ForConditionalGeneration` and gives the engine's logprobs on an image prompt and a text prompt.

The LoRA covers the language model's attention and MLP only, as hosted Tinker trains it (the tower stays frozen);
train_unembed=False because the tiny checkpoint ties its embeddings (see test_qwen3_5_vision_training.py).
Tolerance: 1e-4 absolute on logprobs, as the text export tests (test_qwen3_5_moe_export.py) and the VL training
parity test: float32 on both sides, different summation orders [measured 7.4e-5 on the image prompt, logprobs of
order ten, as that parity test's 7.0e-5; 9.5e-6 on the text prompt]. The adapter moves them by ~10 [12.8, 9.5].
"""

from __future__ import annotations

import numpy as np
import pytest
from cookbook_merge import vl_logprobs
from safetensors.numpy import load_file
from vision_layouts import processed_images

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.checkpoint import ADAPTER_WEIGHTS, write_peft
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, ForwardBackwardResult, LoraConfig

pytestmark = pytest.mark.parity
pytest.importorskip("torch")
pytest.importorskip("transformers")

TOL = 1e-4
SLOT, STEPS = 0, 3


def _datums(directory, engine: Engine) -> tuple[Datum, Datum]:
    """(text, one 100 x 150 image, text; text only), targets the next tokens weighted on text."""
    [image] = processed_images(directory, [(100, 150)])
    image_id = engine.info.image_token_id
    assert image_id is not None
    rng = np.random.default_rng(7)
    with_image = [*rng.integers(0, 1800, 5)] + [image_id - 2] + [image_id] * image.tokens + [image_id - 1]
    layouts = [(with_image + [*rng.integers(0, 1800, 7)], (image,)), ([*rng.integers(0, 1800, 16)], ())]
    out = []
    for tokens, images in layouts:
        full = np.asarray(tokens, np.int32)
        weights = (full[1:] != image_id).astype(np.float32)
        out.append(Datum(full[:-1], {"target_tokens": full[1:].astype(np.int64), "weights": weights}, images=images))
    return out[0], out[1]


def _logprobs(engine: Engine, datum: Datum) -> np.ndarray:
    [res] = engine.forward_backward(
        [ForwardBackwardInput(slot=SLOT, data=[datum], loss_fn="cross_entropy", forward_only=True)]
    )
    assert isinstance(res, ForwardBackwardResult), res
    return np.asarray(res.outputs[0]["logprobs"])


def test_vl_export_merges_into_transformers_with_the_engines_logprobs(tmp_path):
    pytest.importorskip("tinker_cookbook", reason="the cookbook extra is not installed")
    from tinker_cookbook.weights import build_hf_model

    directory = make_tiny_model(tmp_path / "qwen3_5_vl", family="qwen3_5", vision=True)
    engine = Engine.load(str(directory), max_lora_adapters=2, max_lora_rank=8, progress=False)
    config = LoraConfig(rank=4, seed=1, train_attn=True, train_mlp=True, train_unembed=False)
    engine.create_adapter(SLOT, config)
    image_datum, text_datum = _datums(directory, engine)
    for _ in range(STEPS):
        [res] = engine.forward_backward([ForwardBackwardInput(slot=SLOT, data=[image_datum], loss_fn="cross_entropy")])
        assert isinstance(res, ForwardBackwardResult), res
        engine.optim_step(SLOT, AdamConfig(learning_rate=0.05))
    weights = {k: np.asarray(v) for k, v in engine.adapter_weights(SLOT).items()}

    write_peft(config, weights, tmp_path / "adapter", base_model_name_or_path=str(directory))
    keys = set(load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS)))
    assert not any("visual" in k for k in keys), "the tower is frozen: nothing of it is exported"
    build_hf_model(
        base_model=str(directory),
        adapter_path=str(tmp_path / "adapter"),
        output_path=str(tmp_path / "merged"),
        dtype="float32",
        merge_strategy="full",
        device="cpu",
    )
    image_id = engine.info.image_token_id
    for datum in (image_datum, text_datum):
        tokens = np.append(datum.tokens, datum.inputs["target_tokens"][-1]).astype(np.int64)
        ours = _logprobs(engine, datum)
        merged = vl_logprobs(tmp_path / "merged", tokens, datum.images, image_id)
        base = vl_logprobs(directory, tokens, datum.images, image_id)
        assert np.abs(ours - base).max() > 100 * TOL, "the adapter moves the logprobs, so the check bites"
        np.testing.assert_allclose(ours, merged, atol=TOL, rtol=TOL)
