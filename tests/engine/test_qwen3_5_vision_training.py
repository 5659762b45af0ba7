"""Training with images through the engine against transformers 5.23's `Qwen3_5ForConditionalGeneration` on the tiny
vision-language checkpoint (`make-tiny-model --family qwen3_5 --vision`, written offline), float32 on CPU.

One batch holds three datums: one image between text, two images of different sizes in one datum, and a text-only
datum. They are small enough to be packed into one row (three segments), so the test also covers the packing of
datums with and without images. Checked against transformers, with PEFT wrapping every linear of the language model
with the same non-zero A and B as ours (measured values in brackets):

* the model's logits for each datum, when the three run together as one packed batch (`CausalLM.hidden(...,
  images=)` with the family's `image_batch`), at the whole-model tolerance of the qwen3_5 parity tests
  (qwen3_5_reference.logits_close: relative L2 1e-5 overall [up to 6.3e-6], 1e-4 per token [3.2e-5]);
* the engine's forward_backward: each datum's target logprobs within 1e-4 absolute [7.0e-5: logprobs of order ten
  from logits within the 1e-5 relative L2 above] and the loss within 1e-5 relative [2.1e-7];
* the LoRA gradients of every language-model linear within 1e-4 relative L2 [up to 2.4e-5], the tolerance
  test_qwen3_5_lora.py measured and wrote down for a LoRA gradient through the whole Qwen3.5 model (transformers'
  own float32 gradients differ from its float64 ones by up to 2.2e-5 there), not its 1e-5 elementwise one for the
  gated delta rule alone.

The tiny checkpoint ties its embeddings, and our unembedding LoRA updates the tied lookup too (lora.py) where PEFT's
`lm_head` LoRA does not, so the adapter here trains attention and MLP only (train_unembed=False).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from peft_lora import copy_our_lora
from qwen3_5_reference import logits_close
from vision_layouts import next_token_datums, processed_images

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.attention import Segments
from tinkerflow.workers.engine.model.families.qwen3_5.vision_batch import image_batch
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, InputError, LoraConfig

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SLOT, RANK = 1, 4
GRAD_L2 = 1e-4
LOGPROB_TOL, LOSS_RTOL = 1e-4, 1e-5
# (height, width) of the images: 15, 4 and 40 placeholder tokens under the tiny model's processor
SIZES = [(100, 150), (64, 64), (250, 160)]
LORA_TARGETS = (
    r".*language_model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"
    r"|self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_vl") / "qwen3_5_vl", family="qwen3_5", vision=True)


@pytest.fixture(scope="module")
def engine(tiny_vl):
    engine = Engine.load(str(tiny_vl), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.create_adapter(SLOT, LoraConfig(rank=RANK, seed=0, train_unembed=False))
    rng = np.random.default_rng(3)
    weights = {
        name: rng.normal(0.0, 1.0 / np.sqrt(v.shape[0]) if name.endswith("lora_a") else 0.1, v.shape).astype(v.dtype)
        for name, v in engine.adapter_weights(SLOT).items()
        if not name.startswith("lm_head")  # stays zero: see the module docstring
    }
    engine.set_adapter_weights(SLOT, weights)
    return engine


def _datums(tiny_vl, engine: Engine) -> list[Datum]:
    """vision_layouts' three prompts as next-token datums, their images cut by the tiny model's processor."""
    image_id = engine.info.image_token_id
    assert image_id is not None
    images = processed_images(tiny_vl, SIZES)
    return next_token_datums(image_id, images, np.random.default_rng(7), vocab=1800)


def _hf(tiny_vl, engine: Engine):
    """transformers' model with PEFT LoRA holding our slot's A and B; returns (peft model, wrapped modules by path)."""
    import peft

    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny_vl), attn_implementation="eager")
    hf = hf.float().eval()
    alpha = round(engine.adapters.scale(SLOT) * RANK)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=alpha, target_modules=LORA_TARGETS))
    ours = engine.adapter_weights(SLOT)
    wrapped = copy_our_lora(model, ours)
    assert {p.rsplit(".", 1)[0] for p in ours if not p.startswith("lm_head")} == set(wrapped)
    return model, wrapped


def _hf_logits(model, d: Datum, image_id: int):
    ids = torch.from_numpy(d.tokens.astype(np.int64))[None]
    kwargs = {}
    if d.images:
        kwargs = dict(
            pixel_values=torch.from_numpy(np.concatenate([im.patches for im in d.images])),
            image_grid_thw=torch.tensor([im.grid for im in d.images]),
        )
    return model(input_ids=ids, mm_token_type_ids=(ids == image_id).int(), **kwargs).logits[0]


def _packed_logits(engine: Engine, data: list[Datum]) -> list[np.ndarray]:
    """Our logits for the datums packed into one row, as the training step lays them out."""
    tokens = np.concatenate([d.tokens for d in data])[None]
    segments = np.concatenate([np.full(len(d.tokens), i + 1, np.int32) for i, d in enumerate(data)])[None]
    positions = np.concatenate([np.arange(len(d.tokens), dtype=np.int32) for d in data])[None]
    images = image_batch(engine.config, tokens, segments, [im for d in data for im in d.images])
    model = nnx.merge(engine._graphdef, engine.adapters.lora, engine.base)
    routing = LoraRouting(jnp.asarray([SLOT], jnp.int32), jnp.asarray([engine.adapters.scale(SLOT)], jnp.float32))
    h, _ = model.hidden(
        jnp.asarray(tokens), jnp.asarray(positions), routing, segments=Segments(jnp.asarray(segments)), images=images
    )
    logits = np.asarray(model.logits(h, routing))[0]
    bounds = np.cumsum([0] + [len(d.tokens) for d in data])
    return [logits[a:b] for a, b in itertools.pairwise(bounds)]


def test_images_train_as_transformers_computes(tiny_vl, engine):
    data = _datums(tiny_vl, engine)
    image_id = engine.info.image_token_id
    assert image_id is not None
    model, wrapped = _hf(tiny_vl, engine)

    ref_logits = [_hf_logits(model, d, image_id) for d in data]
    for i, (got, want) in enumerate(zip(_packed_logits(engine, data), ref_logits, strict=True)):
        logits_close(got, want.detach().numpy(), f"datum {i}")

    total = 0
    ref_lps = []
    for d, logits in zip(data, ref_logits, strict=True):
        targets = torch.from_numpy(d.inputs["target_tokens"])
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        ref_lps.append(lp.detach().numpy())
        total = total - (lp * torch.from_numpy(d.inputs["weights"])).sum()
    total.backward()  # pyright: ignore[reportAttributeAccessIssue]

    [result] = engine.forward_backward([ForwardBackwardInput(slot=SLOT, data=data, loss_fn="cross_entropy")])
    assert not isinstance(result, Exception), result
    for i, (out, want) in enumerate(zip(result.outputs, ref_lps, strict=True)):
        np.testing.assert_allclose(out["logprobs"], want, atol=LOGPROB_TOL, rtol=0, err_msg=f"datum {i}")
    np.testing.assert_allclose(result.metrics["loss:sum"], float(total), rtol=LOSS_RTOL)

    grads = engine.accumulated_grads(SLOT)
    for path, module in wrapped.items():
        for ours, theirs in (("lora_a", module.lora_A), ("lora_b", module.lora_B)):
            want = theirs["default"].weight.grad.numpy().T
            assert np.abs(want).max() > 0, f"{path}: the reference gradient is zero"
            err = np.linalg.norm(grads[f"{path}.{ours}"] - want) / np.linalg.norm(want)
            assert err <= GRAD_L2, f"{path}.{ours}: relative L2 error {err:.2e}"


def test_a_text_datum_beside_images_is_unchanged(tiny_vl, engine):
    """A text-only datum's logprobs in a batch with images equal those of it alone (the image batch's 3-D positions
    are its plain positions on every axis, so its rope is the text model's): 1e-6 relative, a few float32 ulps of
    logprobs of order ten [measured 5.7e-7], as the two programs fuse their sums differently."""
    data = _datums(tiny_vl, engine)
    run = [ForwardBackwardInput(slot=SLOT, data=data, loss_fn="cross_entropy", forward_only=True)]
    alone = [ForwardBackwardInput(slot=SLOT, data=data[2:], loss_fn="cross_entropy", forward_only=True)]
    [mixed], [text] = engine.forward_backward(run), engine.forward_backward(alone)
    assert not isinstance(mixed, Exception) and not isinstance(text, Exception)
    np.testing.assert_allclose(mixed.outputs[2]["logprobs"], text.outputs[0]["logprobs"], atol=0, rtol=1e-6)


def test_images_of_other_sizes_reuse_the_program_of_their_patch_bucket(tiny_vl, engine):
    """Datums whose images differ in size but whose patches fit one bucket (256) run one compiled program."""
    data = _datums(tiny_vl, engine)
    before = engine.steps.grad_step.compiles
    for datum in data[:2]:  # 60 patches, then 16 + 160
        [out] = engine.forward_backward([ForwardBackwardInput(slot=SLOT, data=[datum], loss_fn="cross_entropy")])
        assert not isinstance(out, Exception), out
    assert engine.steps.grad_step.compiles - before <= 1


@pytest.mark.parametrize("fault", ["placeholder-without-image", "image-without-placeholders", "split-run"])
def test_images_and_placeholders_that_disagree_are_the_senders_error(tiny_vl, engine, fault):
    datum = _datums(tiny_vl, engine)[0]
    image_id = engine.info.image_token_id
    tokens = datum.tokens.copy()
    images = datum.images
    if fault == "placeholder-without-image":
        images = ()
    elif fault == "image-without-placeholders":
        tokens[tokens == image_id] = 5
    else:
        first = int(np.flatnonzero(tokens == image_id)[3])
        tokens = np.concatenate([tokens[:first], [7], tokens[first:-1]]).astype(np.int32)
    bad = Datum(tokens, datum.inputs, images=images)
    [out] = engine.forward_backward([ForwardBackwardInput(slot=SLOT, data=[bad], loss_fn="cross_entropy")])
    assert isinstance(out, InputError), out
    assert "datum 0" in str(out) and "placeholder" in str(out)
