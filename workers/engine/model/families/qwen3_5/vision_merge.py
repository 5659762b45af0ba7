"""Images into the language model: the vision tower's features in place of the image's placeholder tokens, and the
3-D multimodal rotary positions (transformers' `get_rope_index` and the text rotary embedding's interleaved
recomposition) for Qwen3.5 and Qwen3-VL.

An image of patch grid (t, h, w) occupies t * h * w / merge**2 consecutive `image_token_id` tokens of its row (the
prompt holds <vision_start>, the placeholders, <vision_end> as text). Its features (vision.py, one per merge block
in the processor's block order) replace those tokens' embeddings one for one, and its tokens take the positions

    temporal = start + frame,  height = start + block row,  width = start + block column

with `start` the position after the text before it; the text after the image continues from start + max(h, w) /
merge. Text tokens have the same position on all three axes, so a text-only row's positions are 0, 1, 2, ... and
its rope is the text model's plain rope.

How the causal LM calls it (model.py's `hidden` with a vision_batch.ImageBatch; the host half is vision_batch.py):

    mrope, delta = rope_index(tokens, grids, image_token_id=..., merge_size=..., segment_ids=...)   # host, numpy
    features, deepstack = vision_model(patches, vision_inputs(grids, vision_config, length))          # jitted
    x = embed_tokens(tokens)
    mask, index = placeholders(tokens, image_token_id)
    x = scatter_features(x, mask, index, features)
    rope = mrope_tables(mrope, config.inv_freq(), section)   # section = mrope_section(config.json)
    ...then the decoder layers as now; Qwen3-VL adds deepstack[i] after layer i (`DeepStack`, `embed_images`)

`delta` (the last datum's largest position + 1 - its length, per row) is what a sampler adds to a generated
token's index to get its position on all three axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Grid = tuple[int, int, int]


def _datum_positions(tokens: np.ndarray, grids: Sequence[Grid], image_token_id: int, merge: int) -> np.ndarray:
    """[3, len(tokens)] positions of one datum (no padding) whose placeholders are those of `grids`, in order."""
    out = np.zeros((3, len(tokens)), np.int64)
    pos = i = 0
    for t, h, w in grids:
        count = t * h * w // merge**2
        start = i + int(np.argmax(tokens[i:] == image_token_id))
        out[:, i:start] = pos + np.arange(start - i)  # the text before the image
        pos += start - i
        gh, gw = h // merge, w // merge
        frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, start : start + count] = pos + np.stack([frame.ravel(), row.ravel(), col.ravel()])
        pos += max(gh, gw)
        i = start + count
    out[:, i:] = pos + np.arange(len(tokens) - i)
    return out


def rope_index(
    tokens: np.ndarray,
    grids: Sequence[Grid],
    *,
    image_token_id: int,
    merge_size: int,
    segment_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The 3-D positions int32 [3, B, T] of token ids [B, T] and each row's rope delta int32 [B] (module docstring).

    `grids` lists the images' patch grids in the order their placeholders appear, row by row; each image takes the
    next t * h * w / merge_size**2 placeholder tokens, so two images may follow each other without text between.
    `segment_ids` [B, T] (None: each row one datum, every token real) restart positions at each packed datum, as
    the text positions do; padding (0) gets position 0. ValueError when the placeholders and the grids disagree,
    or an image's placeholders are not one consecutive run within one datum."""
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    segs = np.ones((b, t), np.int32) if segment_ids is None else np.asarray(segment_ids)
    is_image = tokens == image_token_id
    counts = [g[0] * g[1] * g[2] // merge_size**2 for g in grids]
    bad = [g for g in grids if g[1] % merge_size or g[2] % merge_size or min(g) < 1]
    if bad:
        raise ValueError(f"image grids {bad} are not whole {merge_size}x{merge_size} blocks")
    if int(is_image[segs > 0].sum()) != sum(counts):
        raise ValueError(
            f"{int(is_image[segs > 0].sum())} image placeholder tokens for {len(grids)} images of {sum(counts)} tokens"
        )
    positions = np.zeros((3, b, t), np.int64)
    deltas = np.zeros(b, np.int64)
    image = 0
    for row in range(b):
        for seg in [s for s in np.unique(segs[row]) if s > 0]:
            where = np.flatnonzero(segs[row] == seg)
            datum = tokens[row, where]
            need, taken = int(is_image[row, where].sum()), 0
            first = image
            while taken < need:
                taken += counts[image]
                image += 1
            if taken != need:
                raise ValueError(f"row {row}: an image's placeholder tokens run past the end of its datum")
            _check_runs(datum == image_token_id, counts[first:image], row)
            datum_positions = _datum_positions(datum, grids[first:image], image_token_id, merge_size)
            positions[:, row, where] = datum_positions
            deltas[row] = datum_positions.max() + 1 - len(where)
    return positions.astype(np.int32), deltas.astype(np.int32)


def _check_runs(is_image: np.ndarray, counts: Sequence[int], row: int) -> None:
    """Each image's placeholders consecutive: the datum's placeholder runs are unions of whole images, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = (edges[1::2] - edges[::2]).tolist()
    ends = set(np.cumsum(counts).tolist())
    if not set(np.cumsum(runs).tolist()) <= ends:
        raise ValueError(f"row {row}: image placeholder runs {runs} do not split into images of {list(counts)} tokens")


def mrope_section(hf: Mapping[str, Any], default: tuple[int, int, int] = (11, 11, 10)) -> tuple[int, int, int]:
    """The rotary frequencies given to the temporal, height and width axes, from a config.json (its text config's
    `rope_parameters.mrope_section`; else the family's default: Qwen3.5's [11, 11, 10], Qwen3-VL's [24, 20, 20])."""
    text = hf.get("text_config") or hf
    rope = text.get("rope_parameters") or {}
    section = tuple(int(s) for s in rope.get("mrope_section", default))
    if len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must have 3 entries (temporal, height, width)")
    return section  # type: ignore[return-value]


def mrope_tables(
    positions: jax.Array, inv_freq: np.ndarray, section: tuple[int, int, int]
) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, 2 * len(inv_freq)] for 3-D positions [3, B, T], rotate-half layout, as decoder.rope_tables.

    Interleaved: frequency j turns with the height position when j % 3 == 1 and j < 3 * section[1], with the width
    position when j % 3 == 2 and j < 3 * section[2], else with the temporal one (transformers' recomposition)."""
    j = np.arange(len(inv_freq))
    axis = np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))
    chosen = jnp.take(jnp.asarray(positions), jnp.asarray(axis), axis=0)  # [F, B, T]: each frequency's position
    freqs = jnp.moveaxis(chosen, 0, -1).astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def placeholders(tokens: jax.Array, image_token_id: int) -> tuple[jax.Array, jax.Array]:
    """Which tokens [B, T] are image placeholders, and for each the row of the features it takes: placeholders
    numbered 0, 1, ... row by row (transformers' masked_scatter order; 0 elsewhere)."""
    mask = tokens == image_token_id
    index = jnp.cumsum(mask.reshape(-1)).reshape(mask.shape) - 1
    return mask, jnp.where(mask, index, 0).astype(jnp.int32)


def scatter_features(x: jax.Array, mask: jax.Array, index: jax.Array, features: jax.Array) -> jax.Array:
    """Embeddings x [B, T, H] with each placeholder's replaced by its feature (`features` [M, H], M at least the
    placeholders: the tower's padded output)."""
    return jnp.where(mask[..., None], jnp.take(features, index, axis=0).astype(x.dtype), x)


def add_features(x: jax.Array, mask: jax.Array, index: jax.Array, features: jax.Array) -> jax.Array:
    """Hidden states x [B, T, H] plus each placeholder's feature (Qwen3-VL's DeepStack, after an early layer)."""
    return x + jnp.where(mask[..., None], jnp.take(features, index, axis=0).astype(x.dtype), 0)


class DeepStack(NamedTuple):
    """Qwen3-VL's DeepStack as decoder.CausalLM.decode's `after_layer`: the tower's extra features [K, M, H] added
    at the image placeholders (`mask`, `index` as `placeholders` gives them) to the residual stream after the
    language model's layers 0 .. K-1 (transformers' `_deepstack_process`); later layers pass x through."""

    mask: jax.Array
    index: jax.Array
    features: jax.Array

    def __call__(self, layer: Any, x: jax.Array) -> jax.Array:
        k = self.features.shape[0]
        if isinstance(layer, int):  # the per-layer loop
            return add_features(x, self.mask, self.index, self.features[layer]) if layer < k else x
        # the scan's traced index: only the first K layers gather their features
        at = jnp.minimum(layer, k - 1)
        return jax.lax.cond(
            layer < k, lambda x: add_features(x, self.mask, self.index, self.features[at]), lambda x: x, x
        )


def embed_images(
    x: jax.Array, tokens: jax.Array, image_token_id: int, features: jax.Array, deepstack: Sequence[jax.Array]
) -> tuple[jax.Array, DeepStack | None]:
    """A training batch's embeddings x [B, T, H] with the tower's `features` [M, H] at the placeholders of `tokens`
    [B, T], and the DeepStack features [M, H] each (None when there are none) for the first layers."""
    mask, index = placeholders(tokens, image_token_id)
    extra = DeepStack(mask, index, jnp.stack(list(deepstack))) if deepstack else None
    return scatter_features(x, mask, index, features), extra


def embed_prompt_features(x: jax.Array, mask: jax.Array, features: jax.Array) -> tuple[jax.Array, DeepStack | None]:
    """The sampler's form of `embed_images`: `features` [R, C, (1 + K) * H] at each prompt token
    (`image_inputs.tower_features` of its placeholder, anything elsewhere), `mask` [R, C] the placeholders. A width
    of H: no DeepStack."""
    r, c, h = x.shape
    x = jnp.where(mask[..., None], features[..., :h].astype(x.dtype), x)
    k = features.shape[-1] // h - 1
    if k == 0:
        return x, None
    extra = jnp.moveaxis(features[..., h:].reshape(r * c, k, h), 1, 0)  # [K, R * C, H], token (i, j) at row i*C + j
    return x, DeepStack(mask, jnp.arange(r * c, dtype=jnp.int32).reshape(r, c), extra)
