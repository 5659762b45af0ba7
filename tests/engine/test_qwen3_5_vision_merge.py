"""Images into Qwen3.5's language model (families/qwen3_5/vision_merge.py) against transformers 5.23: the 3-D rope
positions and deltas against `Qwen3_5Model.get_rope_index` and `Qwen3VLModel.get_rope_index` (text-only rows, two
images in a row, padding on either side), the interleaved cos/sin against the text rotary embeddings, and the
features' scatter against `masked_scatter`; and all of it together against what transformers' composite
`Qwen3_5Model` hands its language model. Positions are integers and the scatter a copy: both compared exactly;
cos/sin at 1e-6 (float32 cos/sin of the same float32 angles).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from tinkerflow.workers.engine.model.families.qwen3_5.vision_merge import (
    add_features,
    mrope_section,
    mrope_tables,
    placeholders,
    rope_index,
    scatter_features,
)

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")

IMAGE, START, END, PAD = 90, 91, 92, 0
MERGE = 2


def _tokens(*parts) -> list[int]:
    """A row from text lengths (ints, filler tokens 1..) and images (grids: start, placeholders, end)."""
    row: list[int] = []
    for part in parts:
        if isinstance(part, int):
            row += list(range(1, part + 1))
        else:
            t, h, w = part
            row += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
    return row


def _batch(rows, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), PAD, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        tokens[i, span], mask[i, span] = r, 1
    return tokens, mask


def _hf_rope_index(kind: str, tokens, mask, grids):
    """transformers' get_rope_index, its `self` reduced to what it reads (the merge size, get_vision_position_ids)."""
    if kind == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model as cls
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as cls
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=MERGE))
    self = types.SimpleNamespace(config=config)
    self.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, self)
    ids = torch.from_numpy(tokens)
    positions, deltas = cls.get_rope_index(
        self,  # pyright: ignore[reportArgumentType]
        ids,
        mm_token_type_ids=(ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
        attention_mask=torch.from_numpy(mask),
    )
    return positions.numpy(), deltas.numpy()[:, 0]


CASES = {
    "text-only": ([[7], [4]], []),
    "one-image": ([[3, (1, 4, 6), 5]], [(1, 4, 6)]),
    "two-images-one-row": ([[2, (1, 4, 6), 3, (1, 8, 2), 4]], [(1, 4, 6), (1, 8, 2)]),
    "image-row-and-text-row": ([[5], [(1, 2, 2), 2, (1, 6, 4)], [1, (1, 4, 4)]], [(1, 2, 2), (1, 6, 4), (1, 4, 4)]),
}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_vl"])
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_index_matches_transformers(kind, left, case):
    parts, grids = CASES[case]
    tokens, mask = _batch([_tokens(*p) for p in parts], left=left)
    want, want_delta = _hf_rope_index(kind, tokens, mask, grids)
    got, got_delta = rope_index(tokens, grids, image_token_id=IMAGE, merge_size=MERGE, segment_ids=mask)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_delta, want_delta)


def test_packed_datums_restart_and_adjacent_images_split_by_their_grids():
    a, b = _tokens(2, (1, 4, 6), 3), _tokens(1, (1, 2, 4), 2, (1, 4, 2), 1)
    row = np.asarray([a + b + [PAD, PAD]])
    segments = np.asarray([[1] * len(a) + [2] * len(b) + [0, 0]])
    grids = [(1, 4, 6), (1, 2, 4), (1, 4, 2)]
    got, delta = rope_index(row, grids, image_token_id=IMAGE, merge_size=MERGE, segment_ids=segments)
    alone_a, _ = rope_index(np.asarray([a]), grids[:1], image_token_id=IMAGE, merge_size=MERGE)
    alone_b, delta_b = rope_index(np.asarray([b]), grids[1:], image_token_id=IMAGE, merge_size=MERGE)
    np.testing.assert_array_equal(got[:, 0], np.concatenate([alone_a[:, 0], alone_b[:, 0], np.zeros((3, 2))], 1))
    assert delta[0] == delta_b[0]
    # two images back to back, no text between: each takes its own count of placeholders
    adjacent = np.asarray([[1] + [IMAGE] * 6 + [IMAGE] * 2 + [2]])
    got, _ = rope_index(adjacent, [(1, 4, 6), (1, 2, 4)], image_token_id=IMAGE, merge_size=MERGE)
    np.testing.assert_array_equal(got[1, 0], [0, 1, 1, 1, 2, 2, 2, 4, 4, 6])  # heights: 2 rows of 3, then 1 row of 2


def test_rope_index_refuses_placeholders_that_disagree_with_the_grids():
    row = np.asarray([_tokens(2, (1, 4, 6), 3)])
    with pytest.raises(ValueError, match="6 image placeholder tokens for 1 images of 8 tokens"):
        rope_index(row, [(1, 4, 8)], image_token_id=IMAGE, merge_size=MERGE)
    split = np.asarray([[1, IMAGE, IMAGE, 2, IMAGE, IMAGE, IMAGE, IMAGE, 3]])
    with pytest.raises(ValueError, match="do not split into images"):
        rope_index(split, [(1, 4, 6)], image_token_id=IMAGE, merge_size=MERGE)
    across = np.asarray([[1, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE]])
    with pytest.raises(ValueError, match="past the end of its datum"):
        rope_index(
            across, [(1, 4, 6)], image_token_id=IMAGE, merge_size=MERGE, segment_ids=np.asarray([[1, 1, 1, 2, 2, 2, 2]])
        )


@pytest.mark.parametrize("section", [(11, 11, 10), (4, 6, 6), (2, 3, 3)])
def test_mrope_tables_match_the_text_rotary_embedding(section):
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    head_dim = 4 * sum(section) * 2  # partial_rotary_factor 0.25: rotary dims = 2 * sum(section)
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)},
    )
    hf = Qwen3_5TextRotaryEmbedding(config)
    tokens, mask = _batch([_tokens(3, (1, 4, 6), 2, (1, 8, 2), 4), _tokens(9)])
    positions, _ = rope_index(tokens, [(1, 4, 6), (1, 8, 2)], image_token_id=IMAGE, merge_size=MERGE, segment_ids=mask)
    with torch.no_grad():
        cos, sin = hf(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions.astype(np.int64)))
    ours = mrope_tables(jnp.asarray(positions), hf.inv_freq.numpy(), mrope_section(config.to_dict()))
    np.testing.assert_allclose(np.asarray(ours[0]), cos.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(ours[1]), sin.numpy(), atol=1e-6, rtol=0)


def test_scatter_and_add_match_masked_scatter():
    rng = np.random.default_rng(0)
    tokens = np.asarray([_tokens(2, (1, 4, 6), 1), _tokens(1, (1, 2, 2), (1, 4, 4), 1)])
    embeds = rng.normal(size=(*tokens.shape, 8)).astype(np.float32)
    features = rng.normal(size=(6 + 1 + 4 + 5, 8)).astype(np.float32)  # 11 placeholders, 5 padding rows after
    mask_t = torch.from_numpy(tokens == IMAGE)[..., None].expand(-1, -1, 8)
    want = torch.from_numpy(embeds).masked_scatter(mask_t, torch.from_numpy(features[:11])).numpy()
    mask, index = placeholders(jnp.asarray(tokens), IMAGE)
    np.testing.assert_array_equal(
        np.asarray(scatter_features(jnp.asarray(embeds), mask, index, jnp.asarray(features))), want
    )
    added = np.asarray(add_features(jnp.asarray(embeds), mask, index, jnp.asarray(features)))
    expected = embeds.copy()
    expected[tokens == IMAGE] += features[:11]
    np.testing.assert_array_equal(added, expected)


def test_the_composite_model_gets_our_embeddings_and_positions():
    """transformers' `Qwen3_5Model` given token ids, pixel rows and grids hands its language model the embeddings
    and 3-D positions we build from our tower's features (1e-5, the tower's tolerance) and `rope_index` (exact):
    images of two rows in order, one row padded."""
    import transformers
    from qwen3_5_vision_reference import VISION, hf_tower, our_tower

    from tinkerflow.workers.engine.model.families.qwen3_5.vision_config import vision_inputs

    sizes: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=VISION["out_hidden_size"],
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        intermediate_size=24,
        full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
    )
    text = transformers.Qwen3_5TextConfig(**sizes)
    config: Any = transformers.Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=dict(VISION),
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    composite = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5Model(config).float().eval()
    tower = hf_tower()
    composite.visual.load_state_dict(tower.state_dict())
    grids = [(1, 4, 6), (1, 8, 4), (1, 2, 2)]
    tokens, mask = _batch([_tokens(3, (1, 4, 6), 2, (1, 8, 4), 1), _tokens(2, (1, 2, 2), 3)])
    n = sum(t * h * w for t, h, w in grids)
    patches = np.random.default_rng(1).normal(size=(n, 96)).astype(np.float32)
    seen = {}

    def capture(module, args, kwargs):
        seen["embeds"], seen["positions"] = kwargs["inputs_embeds"].numpy(), kwargs["position_ids"].numpy()

    composite.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        composite(
            input_ids=ids,
            attention_mask=torch.from_numpy(mask),
            pixel_values=torch.from_numpy(patches),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(ids == IMAGE).int(),
        )

    ours = our_tower(tower)
    features, _ = ours(jnp.asarray(patches), vision_inputs(grids, ours.config))
    embeds = jnp.asarray(composite.language_model.embed_tokens.weight.detach().numpy())[jnp.asarray(tokens)]
    found, index = placeholders(jnp.asarray(tokens), IMAGE)
    got = np.asarray(scatter_features(embeds, found, index, features))
    np.testing.assert_allclose(got, seen["embeds"], atol=1e-5, rtol=1e-5)
    positions, _ = rope_index(tokens, grids, image_token_id=IMAGE, merge_size=MERGE, segment_ids=mask)
    np.testing.assert_array_equal(positions, seen["positions"])
