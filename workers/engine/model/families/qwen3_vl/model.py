"""Qwen3-VL's causal LM (transformers' `Qwen3VLModel` + `lm_head`, and the MoE twin's): model/decoder.py's CausalLM
over the family's layers (Qwen3's, or Qwen3-MoE's routed experts), with the vision tower (`visual`, Qwen3.5's
qwen3_5/vision.py with DeepStack's mergers; plain weights, no LoRA) beside it.

Its own class rather than an image hook in decoder.CausalLM: what images change is before and between the layers
(the embeddings, the rope tables, DeepStack's additions), so the decoder only learned to take its rope tables and an
`after_layer` addition (`CausalLM.decode`) and its layers, scan, cache and LoRA stay the one decoder's. The image
steps themselves are vision_merge.py's, shared with Qwen3.5:

    features, deepstack = visual(patches, vision)         the tower, once for the batch's images
    x = embed(tokens) with the features at the placeholders
    rope = mrope_tables(3-D positions)                     interleaved, `mrope_section` frequencies per axis
    x = decoder layers, adding deepstack[i] at the placeholders after layer i (DeepStack, i < K)

A training batch brings `images` (vision_batch.ImageBatch: patches and positions); the sampler brings
`prompt_images` (image_inputs.PromptImages: per prompt token the tower's output, its feature and DeepStack
features side by side, and the 3-D positions) with a cache. Without either the call is Qwen3's.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp

from ... import decoder
from ...attention import Segments
from ...image_inputs import PromptImages, tower_features
from ...kv_cache import LayerCache, RowCache
from ...lora import LoraRouting, StackedLoraRouting
from ...rope import rope_tables
from ..qwen3_5.vision import VisionModel
from ..qwen3_5.vision_batch import ImageBatch
from ..qwen3_5.vision_merge import embed_images, embed_prompt_features, mrope_tables
from .config import Qwen3VLConfig


class CausalLM(decoder.CausalLM):
    """decoder.CausalLM with the tower (`Family.causal_lm`), built with the same options."""

    def __init__(self, config: Qwen3VLConfig, **options: Any):
        super().__init__(config, **options)
        assert config.vision is not None  # Qwen3VLConfig refuses a config without one
        self.visual = VisionModel(config.vision, options.get("param_dtype", jnp.float32))

    @property
    def vl_config(self) -> Qwen3VLConfig:
        return cast(Qwen3VLConfig, self.config)

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        routing: LoraRouting | StackedLoraRouting,
        cache: LayerCache | RowCache | None = None,
        segments: Segments | None = None,
        *,
        remat: bool | None = None,
        images: ImageBatch | None = None,
        prompt_images: PromptImages | None = None,
    ) -> tuple[jax.Array, LayerCache | RowCache | None]:
        """decoder.CausalLM.hidden, and with `images` (a training batch's, without a cache) or `prompt_images` (the
        sampler's, with one) the image features at the placeholders, the 3-D rope and DeepStack (module doc);
        `positions` then still say where each token's keys go in its cache slot."""
        config = self.vl_config
        x = self.embed(tokens, routing)
        deepstack = None
        if images is not None:
            assert config.image_token_id is not None
            features, extra = self.visual(images.patches, images.vision)
            x, deepstack = embed_images(x, tokens, config.image_token_id, features, extra)
            rope = self._mrope(images.positions)
        elif prompt_images is not None:
            x, deepstack = embed_prompt_features(x, prompt_images.mask, prompt_images.features)
            rope = self._mrope(prompt_images.positions)
        else:  # text only: equal positions on the three axes, where mrope is the plain rope
            rope = rope_tables(config, positions)
        return self.decode(x, positions, rope, routing, cache, segments, remat=remat, after_layer=deepstack)

    def _mrope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The multimodal rope tables of 3-D positions [B, T, 3]."""
        config = self.vl_config
        return mrope_tables(jnp.moveaxis(positions, -1, 0), config.inv_freq(), config.mrope_section)

    def image_features(self, patches: jax.Array, vision: Any) -> jax.Array:
        """The tower's output [patches / merge unit, (1 + K) * H] of a padded run of images' patches: per
        placeholder its feature and its K DeepStack features side by side (image_inputs.tower_features)."""
        return tower_features(*self.visual(patches, vision))
