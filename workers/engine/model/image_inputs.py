"""What a vision-language model's cached call (the sampler's) reads of a prompt's images, whatever its family.

The sampler runs a row's images through the tower once, before its first chunk; every later call (a prompt chunk, a
decode step) hands the model the features it already has (`PromptImages`), and the model puts them at the
placeholders and turns its attention with the 3-D rotary positions. A family that holds a vision tower names its
placeholder token in its config (`image_token_id`) and takes `prompt_images=` in `hidden`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from .families import ModelConfig


@functools.partial(jax.tree_util.register_dataclass, data_fields=["features", "mask", "positions"], meta_fields=[])
@dataclass(frozen=True)
class PromptImages:
    """Tokens the sampler runs with a cache whose images' features it computed before (a prompt chunk, or a decode
    step): `features` [R, C, H] the tower's feature at each placeholder (anything elsewhere), `mask` bool [R, C] the
    placeholders, `positions` int32 [R, C, 3] every token's 3-D rotary positions (the cache is still indexed by
    the 1-D `positions` the call is given: a token's place in its row)."""

    features: Any
    mask: Any
    positions: Any


def image_token_id(config: ModelConfig) -> int | None:
    """The image placeholder token of a config whose model holds a vision tower (a family's own field), else None."""
    return getattr(config, "image_token_id", None)


def takes_images(config: ModelConfig) -> bool:
    """The model holds a vision tower: its sampler programs carry the images' features and 3-D positions."""
    return image_token_id(config) is not None


def feature_width(config: ModelConfig) -> int:
    """How wide the sampler keeps a placeholder's features: the tower's feature and its DeepStack features side by
    side (`tower_features`; a family's `image_feature_size`), else the hidden size."""
    return getattr(config, "image_feature_size", config.hidden_size)


def tower_features(features: jax.Array, deepstack: Sequence[jax.Array]) -> jax.Array:
    """What a tower's call gives for a placeholder in one array [M, (1 + K) * H]: its feature, then its DeepStack
    features (none for Qwen3.5), side by side, as the sampler keeps them per prompt token."""
    return jnp.concatenate([features, *deepstack], axis=-1) if deepstack else features
