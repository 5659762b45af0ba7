"""Qwen3.5's vision tower (families/qwen3_5/vision.py) against transformers 5.23's `Qwen3_5VisionModel` at float32 on
CPU, and Qwen3-VL's (`Qwen3VLVisionModel`: the same tower plus DeepStack mergers): one image; two images of different
grids in one call, each attending only within itself; padding after them changing nothing; and the per-patch
inputs (positions, position-table taps) against transformers' own helpers. The fixture is
tests/engine/qwen3_5_vision_reference.py.

Tolerance: 1e-5 absolute and relative on the merged and DeepStack features. Features are of order one (up to 2;
the fixture says how), where float32 rounding stays near 1e-6 after three blocks (measured: ours 1.3e-6 from
transformers' float32, 8.7e-7 from its float64, which is itself 8.8e-7 from its float32). A wrong formula moves
features by order one (measured: the rope's row and column swapped 0.73, the position table read one column off
0.97).
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen3_5_vision_reference import VISION, hf_tower, our_tower

from tinkerflow.common.images import ImageProcessing, decode_image, preprocess
from tinkerflow.workers.engine.model.families.qwen3_5.vision import segment_attention
from tinkerflow.workers.engine.model.families.qwen3_5.vision_checkpoint import VisionNames
from tinkerflow.workers.engine.model.families.qwen3_5.vision_config import VisionConfig, vision_inputs

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")

TOL = 1e-5
PATCH_DIM = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2


def _close(actual, desired, msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), atol=TOL, rtol=TOL, err_msg=msg)


def _patches(grids, seed=0) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).normal(0.0, 1.0, (n, PATCH_DIM)).astype(np.float32)


def _hf_forward(hf, patches, grids):
    with torch.no_grad():
        out = hf(torch.from_numpy(patches), grid_thw=torch.tensor(grids, dtype=torch.long), return_dict=True)
    deepstack = [f.numpy() for f in getattr(out, "deepstack_features", None) or []]
    return out.pooler_output.numpy(), deepstack


def _ours(model, patches, grids, length=None):
    inputs = vision_inputs(grids, model.config, length)
    padded = np.pad(patches, ((0, len(inputs.segments) - len(patches)), (0, 0)))
    merged, deepstack = jax.jit(lambda m, p, i: m(p, i))(model, jnp.asarray(padded), inputs)
    return np.asarray(merged), [np.asarray(f) for f in deepstack]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def towers(request):
    hf = hf_tower(deepstack=(0, 2) if request.param == "qwen3_vl" else ())
    return hf, our_tower(hf)


@pytest.mark.parametrize(
    "grids",
    [[(1, 4, 6)], [(1, 4, 6), (1, 8, 4)], [(1, 2, 2), (1, 6, 10), (1, 4, 4)]],
    ids=["one-image", "two-images", "three-images"],
)
def test_tower_matches_transformers(towers, grids):
    hf, ours = towers
    patches = _patches(grids)
    want, want_deep = _hf_forward(hf, patches, grids)
    got, got_deep = _ours(ours, patches, grids)
    _close(got, want, "merged features")
    assert len(got_deep) == len(want_deep)
    for i, (g, w) in enumerate(zip(got_deep, want_deep, strict=True)):
        _close(g, w, f"deepstack feature {i}")


def test_padding_and_neighbours_change_nothing(towers):
    """An image's features are the same alone, next to another image, and with padding after them: attention never
    crosses an image's boundary."""
    _, ours = towers
    a, b = (1, 4, 6), (1, 8, 4)
    pa, pb = _patches([a], seed=1), _patches([b], seed=2)
    alone, _ = _ours(ours, pa, [a])
    together, _ = _ours(ours, np.concatenate([pa, pb]), [a, b], length=96)
    assert together.shape == (96 // 4, VISION["out_hidden_size"])
    _close(together[: len(alone)], alone, "image a, alone vs. beside b and padding")
    b_alone, _ = _ours(ours, pb, [b])
    _close(together[len(alone) : len(alone) + len(b_alone)], b_alone, "image b")


def test_per_patch_inputs_match_transformers_helpers():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    config = VisionConfig.from_hf(VISION)
    grids = [(1, 4, 6), (1, 8, 4), (2, 2, 2), (1, 12, 14)]
    inputs = vision_inputs(grids, config, length=sum(t * h * w for t, h, w in grids) + 8)
    grid_thw = torch.tensor(grids)
    n = sum(t * h * w for t, h, w in grids)
    positions = get_vision_position_ids(grid_thw, config.spatial_merge_size).numpy()
    index, weight = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=6, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    np.testing.assert_array_equal(inputs.positions[:n], positions)
    np.testing.assert_array_equal(inputs.interp_index[:n], index.numpy())
    np.testing.assert_array_equal(inputs.interp_weight[:n], weight.numpy())
    segments = np.repeat([1, 2, 3, 4], [t * h * w for t, h, w in grids])
    np.testing.assert_array_equal(inputs.segments, np.concatenate([segments, np.zeros(8, np.int32)]))


def test_segment_attention_blocks_equal_one_block():
    """Queries taken 5 at a time (blocks not aligned to images, the last one partial) equal all at once."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(23, 2, 8)), jnp.float32) for _ in range(3))
    segments = jnp.asarray([1] * 7 + [2] * 12 + [0] * 4, jnp.int32)
    whole = segment_attention(q, k, v, segments, block=64)
    _close(segment_attention(q, k, v, segments, block=5), whole)
    assert not np.asarray(whole[19:]).any()  # padding answers zero


def test_config_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_hf({**VISION, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="must be a square"):
        VisionConfig.from_hf({**VISION, "num_position_embeddings": 35})
    with pytest.raises(ValueError, match="whole 2x2 patch blocks"):
        vision_inputs([(1, 3, 4)], VisionConfig.from_hf(VISION))
    config = VisionConfig.from_hf(VISION)
    config.check_processing(ImageProcessing(patch_size=4))
    with pytest.raises(ValueError, match=r"\(16, 2, 2\) differ from the vision tower's \(4, 2, 2\)"):
        config.check_processing(ImageProcessing())


def test_attention_scratch_grows_linearly_with_patches():
    """Four times the patches, at most four times (plus a margin) the compiled scratch memory: the attention's
    scores live one query block at a time, never [heads, N, N] (which would take sixteen times)."""

    def temp_bytes(n: int) -> int:
        q = jax.ShapeDtypeStruct((n, 4, 16), jnp.float32)
        seg = jax.ShapeDtypeStruct((n,), jnp.int32)
        analysis = jax.jit(segment_attention).lower(q, q, q, seg).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(8192)
    assert 0 < large <= 4.25 * small, f"attention scratch {small} B at 2,048 patches, {large} B at 8,192"


def test_png_bytes_to_features_match_transformers_processor_and_tower(towers):
    """Image bytes through our decode, preprocess and tower equal transformers' processor and tower on the same PIL
    image: the patch rows' layout is what the tower's patch embedding reads."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf, ours = towers
    processing = ImageProcessing(min_pixels=16 * 16, max_pixels=48 * 48, patch_size=4, temporal_patch_size=2)
    hf_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": processing.min_pixels, "longest_edge": processing.max_pixels},
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=list(processing.image_mean),
        image_std=list(processing.image_std),
    )
    rng = np.random.default_rng(5)
    images = []
    for height, width in [(30, 45), (70, 20)]:
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
        images.append(decode_image(out.getvalue(), "png"))
    processed = [preprocess(image, processing) for image in images]
    grids = [p.grid for p in processed]
    got, _ = _ours(ours, np.concatenate([p.patches for p in processed]), grids)
    theirs = hf_processor(images=images, return_tensors="np")
    want, _ = _hf_forward(hf, theirs["pixel_values"], [list(g) for g in theirs["image_grid_thw"]])
    _close(got, want, "features from png bytes")
    assert len(got) == sum(p.tokens for p in processed)


def test_checkpoint_names_map_by_their_dots():
    names = VisionNames()
    assert names.state_path("model.visual.blocks.2.attn.qkv.weight") == (
        ("visual", "blocks", 2, "attn", "qkv", "kernel"),
        True,
    )
    assert names.state_path("model.visual.blocks.0.norm1.weight") == (("visual", "blocks", 0, "norm1", "weight"), False)
    assert names.state_path("model.visual.deepstack_merger_list.1.norm.bias") == (
        ("visual", "deepstack_merger_list", 1, "norm", "bias"),
        False,
    )
    assert names.state_path("model.visual.pos_embed.weight") == (("visual", "pos_embed", "weight"), False)
    assert names.state_path("model.language_model.layers.0.mlp.up_proj.weight") is None
    assert names.state_path("model.visual.patch_embed.proj.weight") is None  # gathered: reshaped, not mapped
    with pytest.raises(ValueError, match=r"lacks model\.visual\.patch_embed\.proj\.weight"):
        list(names.gathered())
    conv = np.arange(5 * 3 * 2 * 4 * 4, dtype=np.float32).reshape(5, 3, 2, 4, 4)
    assert names.gather("model.visual.patch_embed.proj.weight", lambda: conv)
    [(path, kernel)] = list(names.gathered())
    assert path == ("visual", "patch_embed", "proj", "kernel")
    np.testing.assert_array_equal(kernel, conv.reshape(5, 96).T)


def test_bfloat16_weights_stay_near_float32():
    """Weights in bfloat16 (as on accelerators; norms stay float32): features within a relative L2 error of 2e-2 of
    the float32 tower's [measured 5.4e-3: bfloat16 rounds each matmul input at 2**-8 = 3.9e-3], and float32 out."""
    hf = hf_tower(deepstack=(1,))
    grids = [(1, 4, 6), (1, 8, 4)]
    patches = _patches(grids)
    full, _ = _ours(our_tower(hf), patches, grids)
    half, deep = _ours(our_tower(hf, param_dtype=jnp.bfloat16), patches, grids)
    assert half.dtype == deep[0].dtype == np.float32
    error = np.linalg.norm(half - full) / np.linalg.norm(full)
    assert error <= 2e-2, f"relative L2 error {error:.2e} between bfloat16 and float32 weights"
