"""The tiny vision-language checkpoints (`make-tiny-model --family qwen3_5 --vision`, `--family qwen3_vl`) against
transformers 5.23, offline: each loads as its `...ForConditionalGeneration` with no missing or unexpected tensor, its
vision token ids are its tokenizer's, transformers' own image processor reads its preprocessor_config.json and counts
the same tokens as tinkerflow.common.images, and its tower (with Qwen3-VL's DeepStack mergers), placed by
vision_checkpoint.py's names, equals transformers'.

Tolerances: 1e-5 on the patch rows (values in [-1, 1]); on the tower's float32 features 1e-5 relative to their
largest magnitude (test_qwen3_5_vision.py's 1e-5 is for features of order one; the tiny checkpoint's weights,
drawn ~ N(0, 0.25), make features of order ten, and float32 rounding grows with them).
"""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen3_5_vision_reference import our_tower

from tinkerflow.common.images import ImageProcessing, decode_image, model_image_processor, preprocess, token_count
from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.families.qwen3_5.vision_checkpoint import PREFIX, VisionNames
from tinkerflow.workers.engine.model.families.qwen3_5.vision_config import vision_inputs
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model, tiny_families

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-5
SIZES = [(100, 150), (30, 40), (1000, 700), (64, 64), (257, 513), (20, 3000)]  # (height, width)


CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def tiny_vl(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_vl") / request.param, family=request.param, vision=True)


@pytest.fixture(scope="module")
def hf_model(tiny_vl):
    model, info = getattr(transformers, CLASSES[tiny_vl.name]).from_pretrained(
        str(tiny_vl), output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    return model.float().eval()


def _png(height: int, width: int, seed: int = 0) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_only_families_with_a_vision_twin_offer_one(tmp_path):
    assert tiny_families(vision=True) == ["qwen3_5", "qwen3_vl"]
    with pytest.raises(ValueError, match="has no vision-language tiny checkpoint; those that have: qwen3_5, qwen3_vl"):
        make_tiny_model(tmp_path / "m", family="qwen3", vision=True)


def test_vision_token_ids_are_the_tokenizers(tiny_vl):
    config = json.loads((tiny_vl / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_vl))
    for token, key in [
        ("<|vision_start|>", "vision_start_token_id"),
        ("<|vision_end|>", "vision_end_token_id"),
        ("<|image_pad|>", "image_token_id"),
        ("<|video_pad|>", "video_token_id"),
    ]:
        assert tok.convert_tokens_to_ids(token) == config[key], token
        assert tok.decode([config[key]]) == token


def test_the_engine_reads_its_text_model_and_the_api_its_image_rules(tiny_vl):
    """The engine's family of each reads the composite config, tower and placeholder token included; the worker's
    card carries the processor."""
    config = json.loads((tiny_vl / "config.json").read_text())
    read = ModelConfig.from_hf(config)
    assert read.arch == tiny_vl.name
    assert getattr(read, "image_token_id", None) == config["image_token_id"]
    found = model_image_processor(tiny_vl)
    assert found is not None
    assert found == json.loads((tiny_vl / "preprocessor_config.json").read_text())
    assert ImageProcessing.from_hf(found) == ImageProcessing(min_pixels=64 * 64, max_pixels=256 * 256)


def test_transformers_image_processor_counts_the_same_tokens(tiny_vl):
    """transformers' processor, loaded from the checkpoint's own preprocessor_config.json, and ours agree on each
    image's grid, token count and patch rows."""
    hf_processor = transformers.AutoImageProcessor.from_pretrained(str(tiny_vl))
    assert type(hf_processor).__name__.startswith("Qwen2VLImageProcessor")
    processing = ImageProcessing.from_hf(model_image_processor(tiny_vl) or {})
    for height, width in SIZES:
        image = decode_image(_png(height, width), "png")
        theirs = hf_processor(images=[image], return_tensors="np")
        ours = preprocess(image, processing)
        assert tuple(int(v) for v in theirs["image_grid_thw"][0]) == ours.grid, (height, width)
        assert hf_processor.get_number_of_image_patches(height, width, {}) // 4 == ours.tokens
        assert token_count(height, width, processing) == ours.tokens
        np.testing.assert_allclose(ours.patches, theirs["pixel_values"], atol=TOL, rtol=TOL)


def test_every_tower_tensor_has_a_place(tiny_vl):
    from safetensors import safe_open

    names = VisionNames()
    with safe_open(str(tiny_vl / "model.safetensors"), "np") as f:
        visual = [n for n in f.keys() if n.startswith(PREFIX)]  # noqa: SIM118 (safe_open is no Mapping)
        for name in visual:
            assert names.state_path(name) is not None or names.gather(name, lambda n=name: f.get_tensor(n)), name
    deepstack = len(
        json.loads((tiny_vl / "config.json").read_text())["vision_config"].get("deepstack_visual_indexes", [])
    )
    assert len(visual) == 3 + 12 * 2 + 6 * (1 + deepstack)  # patch embed (2), positions, 12 per block, 6 per merger
    assert [path for path, _ in names.gathered()] == [("visual", "patch_embed", "proj", "kernel")]


def test_tower_on_a_png_matches_transformers(tiny_vl, hf_model):
    """Bytes -> our preprocess -> our tower (the checkpoint's weights) equals transformers' processor and tower."""
    processing = ImageProcessing.from_hf(model_image_processor(tiny_vl) or {})
    hf_processor = transformers.AutoImageProcessor.from_pretrained(str(tiny_vl))
    ours = our_tower(hf_model.model.visual)
    image = decode_image(_png(100, 150, seed=3), "png")
    processed = preprocess(image, processing)
    inputs = vision_inputs([processed.grid], ours.config, None)
    padded = np.pad(processed.patches, ((0, len(inputs.segments) - len(processed.patches)), (0, 0)))
    got, got_deepstack = jax.jit(lambda m, p, i: m(p, i))(ours, jnp.asarray(padded), inputs)
    theirs = hf_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = hf_model.model.visual(theirs["pixel_values"], grid_thw=theirs["image_grid_thw"], return_dict=True)
    want = [out.pooler_output.numpy(), *[f.numpy() for f in getattr(out, "deepstack_features", None) or []]]
    assert len(want[0]) == processed.tokens == 15
    assert len(want) == 1 + len(got_deepstack)
    for ours_, theirs_ in zip([got, *got_deepstack], want, strict=True):
        scale = float(np.abs(theirs_).max())
        np.testing.assert_allclose(np.asarray(ours_)[: processed.tokens], theirs_, atol=TOL * scale, rtol=0)
