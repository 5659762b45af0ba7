"""A tiny random Qwen3.5 vision tower (and Qwen3-VL's, with DeepStack mergers) in transformers 5.23, the same weights
in ours (families/qwen3_5/vision.py, placed by vision_checkpoint.py's names), for the test_qwen3_5_vision* parity tests.

Sizes differ from each other so a transposed or swapped axis cannot pass: hidden 32 in 4 heads of 8, MLP 48, patches
of 4 x 4 pixels x 2 frames x 3 channels (96 values), merge 2 x 2, out 40, a 6 x 6 learned position table (so a
4 x 6 and an 8 x 4 grid both resample it). Weights moved away from their init: linears ~ N(0, 1 / fan_in) with
biases ~ N(0, 0.1), LayerNorm weights ~ 1 + N(0, 0.3) and biases ~ N(0, 0.3), the position table ~ N(0, 0.5):
activations of order one, where float32 rounding stays near 1e-6.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tinkerflow.workers.engine.model.families.qwen3_5.vision import VisionModel
from tinkerflow.workers.engine.model.families.qwen3_5.vision_checkpoint import PREFIX, VisionNames
from tinkerflow.workers.engine.model.families.qwen3_5.vision_config import VisionConfig

VISION: dict[str, Any] = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    in_channels=3,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=40,
    num_position_embeddings=36,
)


def hf_tower(*, deepstack: tuple[int, ...] = (), seed: int = 0):
    """transformers' vision model, float32, eval, eager attention, weights randomised; Qwen3-VL's when `deepstack`
    names blocks."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if deepstack:
        vl = transformers.Qwen3VLVisionConfig(**VISION, deepstack_visual_indexes=list(deepstack))
        vl._attn_implementation = "eager"
        model = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel(vl)
    else:
        config = transformers.Qwen3_5VisionConfig(**VISION)
        config._attn_implementation = "eager"
        model = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(config)
    model = model.float().eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "pos_embed.weight":
                value = rng.normal(0.0, 0.5, p.shape)
            elif "norm" in name and name.endswith("weight"):
                value = 1.0 + rng.normal(0.0, 0.3, p.shape)
            elif "norm" in name:
                value = rng.normal(0.0, 0.3, p.shape)
            elif name.endswith("bias"):
                value = rng.normal(0.0, 0.1, p.shape)
            else:  # linears [out, in] and the Conv3d [out, C, T, P, P]
                value = rng.normal(0.0, 1.0 / np.sqrt(np.prod(p.shape[1:])), p.shape)
            p.copy_(torch.from_numpy(np.asarray(value, np.float32)))
    return model


def our_tower(hf, param_dtype=jnp.float32) -> VisionModel:
    """Ours for transformers' `hf`, every tensor placed by `VisionNames` as the loader places a checkpoint's, in
    the dtype our leaf declares (every leaf of ours filled exactly once)."""
    model = VisionModel(VisionConfig.from_hf(hf.config.to_dict()), param_dtype=param_dtype)
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    names, filled = VisionNames(root=()), []

    def place(path: tuple, value: np.ndarray) -> None:
        node = pure
        for key in path[:-1]:
            node = node[key]
        assert tuple(node[path[-1]].shape) == value.shape, f"{path}: {node[path[-1]].shape} vs {value.shape}"
        node[path[-1]] = jnp.asarray(value, node[path[-1]].dtype)
        filled.append(path)

    for name, tensor in hf.state_dict().items():
        value = tensor.detach().numpy()
        if names.gather(PREFIX + name, lambda value=value: value):
            continue
        target = names.state_path(PREFIX + name)
        assert target is not None, name
        path, transpose = target
        place(path, value.T if transpose else value)
    for path, value in names.gathered():
        place(path, value)
    leaves = [path for path, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
    assert len(filled) == len(set(filled)) == len(leaves), f"{len(filled)} tensors placed for {len(leaves)} leaves"
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
