"""Training with images through the engine against transformers 5.23's `Qwen3VLForConditionalGeneration` and
`Qwen3VLMoeForConditionalGeneration` + PEFT LoRA, float32 on CPU, on tiny random checkpoints written by transformers
(qwen3_vl_checkpoint.py) and loaded through the engine's loader.

One batch holds three datums: one image between text, two images of different sizes in one datum, and a text-only
datum; the engine packs them into one row (three segments). PEFT wraps every language-model linear that is a
`Linear` (attention and dense MLPs; transformers 5's fused experts are not, so the experts' LoRA stays zero here,
test_moe_lora.py covers it) with the same non-zero A and B as ours. Checked, at float32 tolerances written here
(measured values in brackets):

* the tower's features and DeepStack features (`CausalLM.image_features`) and the merged embeddings: the features
  at the placeholders and DeepStack's per-placeholder additions, as transformers hands them to its language model:
  1e-5 absolute on values of order one [up to 2.0e-6];
* the logits of each datum from one packed call (`hidden(..., images=)` with the family's `image_batch`): 1e-5
  relative to their largest magnitude [5.7e-6];
* the engine's forward_backward: each datum's target logprobs within 1e-5 relative [3.2e-6: logprobs of order ten,
  whose float32 ulp is 1e-6 to 2e-6], the loss within 1e-5 relative [6.2e-8], and every wrapped linear's LoRA
  gradients within 1e-5 relative L2 [up to 6.4e-6].
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from peft_lora import copy_our_lora
from qwen3_vl_checkpoint import PATCH, TEMPORAL, build_qwen3_vl
from vision_layouts import next_token_datums

from tinkerflow.common.images import ProcessedImage
from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.attention import Segments
from tinkerflow.workers.engine.model.families import family_named
from tinkerflow.workers.engine.model.families.qwen3_5.vision_merge import DeepStack, embed_images
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SLOT, RANK = 1, 4
FEATURE_TOL, LOGIT_RTOL, LOGPROB_RTOL, LOSS_RTOL, GRAD_L2 = 1e-5, 1e-5, 1e-5, 1e-5, 1e-5
GRIDS = [(1, 4, 6), (1, 4, 4), (1, 8, 6)]  # 6, 4 and 12 placeholders; patch grids (t, h, w)
LORA_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def checkpoint(request, tmp_path_factory):
    return build_qwen3_vl(tmp_path_factory.mktemp(request.param), moe=request.param.endswith("moe"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = Engine.load(str(checkpoint), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.create_adapter(SLOT, LoraConfig(rank=RANK, seed=0, train_unembed=False))
    rng = np.random.default_rng(3)
    weights = {
        name: rng.normal(0.0, 1.0 / np.sqrt(v.shape[0]) if name.endswith("lora_a") else 0.1, v.shape).astype(v.dtype)
        for name, v in engine.adapter_weights(SLOT).items()
        if not name.startswith("lm_head") and ".experts." not in name  # stay zero: see the module docstring
    }
    engine.set_adapter_weights(SLOT, weights)
    return engine


@pytest.fixture(scope="module")
def hf(checkpoint, engine):
    """transformers' model with PEFT LoRA holding our slot's A and B; (peft model, wrapped modules by our path)."""
    import peft

    config = engine.config
    model = getattr(transformers, CLASSES[config.arch]).from_pretrained(str(checkpoint), attn_implementation="eager")
    alpha = round(engine.adapters.scale(SLOT) * RANK)
    model = peft.get_peft_model(
        model.float().eval(), peft.LoraConfig(r=RANK, lora_alpha=alpha, target_modules=LORA_TARGETS)
    )
    ours = engine.adapter_weights(SLOT)
    wrapped = copy_our_lora(model, ours)
    expected = {p.rsplit(".", 1)[0] for p in ours if not p.startswith("lm_head") and ".experts." not in p}
    assert expected == set(wrapped)
    return model, wrapped


def _datums(engine: Engine) -> list[Datum]:
    """One image; two images of different sizes; text only. Targets are the next tokens, weighted on text."""
    rng = np.random.default_rng(7)
    images = [
        ProcessedImage(rng.uniform(-1, 1, (t * h * w, 3 * TEMPORAL * PATCH**2)).astype(np.float32), (t, h, w), 2)
        for t, h, w in GRIDS
    ]
    image_id = engine.info.image_token_id
    assert image_id is not None
    return next_token_datums(image_id, images, rng, vocab=image_id - 2)  # text below the vision tokens


def _hf_inputs(d: Datum, image_id: int) -> dict:
    ids = torch.from_numpy(d.tokens.astype(np.int64))[None]
    kwargs = dict(input_ids=ids, mm_token_type_ids=(ids == image_id).int())
    if d.images:
        kwargs["pixel_values"] = torch.from_numpy(np.concatenate([im.patches for im in d.images]))
        kwargs["image_grid_thw"] = torch.tensor([im.grid for im in d.images])
    return kwargs


def _packed(engine: Engine, data: list[Datum]):
    """Our model, routing, and the datums packed into one row as the training step lays them out."""
    tokens = np.concatenate([d.tokens for d in data])[None]
    segments = np.concatenate([np.full(len(d.tokens), i + 1, np.int32) for i, d in enumerate(data)])[None]
    positions = np.concatenate([np.arange(len(d.tokens), dtype=np.int32) for d in data])[None]
    batcher = family_named(engine.config.arch).image_batch
    assert batcher is not None
    images = batcher(engine.config, tokens, segments, [im for d in data for im in d.images])
    model = nnx.merge(engine._graphdef, engine.adapters.lora, engine.base)
    routing = LoraRouting(jnp.asarray([SLOT], jnp.int32), jnp.asarray([engine.adapters.scale(SLOT)], jnp.float32))
    return model, routing, tokens, segments, positions, images


def test_features_and_merged_embeddings_match_transformers(engine, hf):
    """The tower's features, DeepStack's, and the embeddings with them at the placeholders, against what
    transformers' Qwen3VLModel hands its language model (captured at the language model's call)."""
    model_hf, _ = hf
    data = _datums(engine)
    model, routing, tokens, _, _, images = _packed(engine, data)
    features, deepstack = model.visual(images.patches, images.vision)
    x, extra = embed_images(
        model.embed(jnp.asarray(tokens), routing), jnp.asarray(tokens), engine.info.image_token_id, features, deepstack
    )
    assert isinstance(extra, DeepStack) and extra.features.shape[0] == 2
    together = np.asarray(model.image_features(images.patches, images.vision))
    np.testing.assert_array_equal(together, np.concatenate([features, *deepstack], axis=-1))

    seen = {}
    language_model = model_hf.base_model.model.model.language_model
    hook = language_model.register_forward_pre_hook(lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True)
    bounds = np.cumsum([0] + [len(d.tokens) for d in data])
    mask = np.asarray(extra.mask)[0]
    try:
        for d, (a, b) in zip(data, itertools.pairwise(bounds), strict=True):
            with torch.no_grad():
                model_hf(**_hf_inputs(d, engine.info.image_token_id))
            np.testing.assert_allclose(
                np.asarray(x)[0, a:b], seen["inputs_embeds"][0].numpy(), atol=FEATURE_TOL, rtol=0
            )
            if not d.images:
                assert seen["deepstack_visual_embeds"] is None
                continue
            at = np.asarray(extra.index)[0, a:b][mask[a:b]]
            theirs_all = seen["deepstack_visual_embeds"]
            assert theirs_all is not None and len(theirs_all) == 2
            for k, theirs in enumerate(theirs_all):
                ours = np.asarray(extra.features[k])[at]
                np.testing.assert_allclose(ours, theirs.numpy(), atol=FEATURE_TOL, rtol=0, err_msg=f"DeepStack {k}")
    finally:
        hook.remove()


def test_images_train_as_transformers_computes(engine, hf):
    model_hf, wrapped = hf
    data = _datums(engine)
    image_id = engine.info.image_token_id
    model, routing, tokens, segments, positions, images = _packed(engine, data)
    hidden, _ = model.hidden(
        jnp.asarray(tokens), jnp.asarray(positions), routing, segments=Segments(jnp.asarray(segments)), images=images
    )
    logits = np.asarray(model.logits(hidden, routing))[0]
    bounds = np.cumsum([0] + [len(d.tokens) for d in data])

    total = torch.zeros(())
    ref_lps = []
    for i, (d, (a, b)) in enumerate(zip(data, itertools.pairwise(bounds), strict=True)):
        theirs = model_hf(**_hf_inputs(d, image_id)).logits[0]
        want = theirs.detach().numpy()
        np.testing.assert_allclose(
            logits[a:b], want, atol=LOGIT_RTOL * np.abs(want).max(), rtol=0, err_msg=f"datum {i}"
        )
        targets = torch.from_numpy(d.inputs["target_tokens"])
        lp = torch.log_softmax(theirs, -1).gather(-1, targets[:, None])[:, 0]
        ref_lps.append(lp.detach().numpy())
        total = total - (lp * torch.from_numpy(d.inputs["weights"])).sum()
    total.backward()

    [result] = engine.forward_backward([ForwardBackwardInput(slot=SLOT, data=data, loss_fn="cross_entropy")])
    assert not isinstance(result, Exception), result
    for i, (out, want) in enumerate(zip(result.outputs, ref_lps, strict=True)):
        np.testing.assert_allclose(out["logprobs"], want, atol=0, rtol=LOGPROB_RTOL, err_msg=f"datum {i}")
    np.testing.assert_allclose(result.metrics["loss:sum"], float(total.detach()), rtol=LOSS_RTOL)

    grads = engine.accumulated_grads(SLOT)
    for path, module in wrapped.items():
        for ours, theirs in (("lora_a", module.lora_A), ("lora_b", module.lora_B)):
            want = theirs["default"].weight.grad.numpy().T
            assert np.abs(want).max() > 0, f"{path}: the reference gradient is zero"
            err = np.linalg.norm(grads[f"{path}.{ours}"] - want) / np.linalg.norm(want)
            assert err <= GRAD_L2, f"{path}.{ours}: relative L2 error {err:.2e}"
