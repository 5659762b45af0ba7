"""Qwen3.5's vision tower (transformers' `Qwen3_5VisionModel`; with `deepstack_visual_indexes`, Qwen3-VL's
`Qwen3VLVisionModel`) in Flax NNX: image patches in, one feature per merge_size x merge_size block of patches out,
in the language model's hidden size, ready to take the place of the image's placeholder tokens (vision_merge.py).

    x = patch_embed(patches) + bilinear(pos_embed, grid)       the Conv3d over one patch is a matmul
    x = x + attn(norm1(x)); x = x + mlp(norm2(x))              per block: bidirectional within one image, 2-D rope
    out = merger(x)                                            LayerNorm, then 4 patches -> fc1 -> GELU -> fc2

All the images of a call go through as one sequence of patches (`VisionInputs`, vision_config.py, says which image
each patch belongs to and where it sits), padded to a fixed length so compiled programs are few: a patch attends to
the patches of its own image only, and padding (segment 0) answers zero.

Attribute names mirror transformers' module tree (`patch_embed.proj`, `pos_embed`, `blocks.N.attn.qkv`,
`blocks.N.mlp.linear_fc1`, `merger.norm`, `deepstack_merger_list.N`, ...) so a loader maps `model.visual.*` tensors
mechanically: a `Linear`'s `kernel` is the checkpoint's `weight` transposed, and `patch_embed.proj.kernel` is the
Conv3d's [hidden, C, T, P, P] weight flattened to [hidden, C * T * P * P] and transposed (its input rows are the
image processor's patch rows, flattened in that same C, T, P, P order).

Plain weights, no LoRA: Tinker's LoRA targets are the language model's (train_attn, train_mlp, train_unembed), and a
tower without adapters gives every adapter the same image features, so one pass serves all the rows of a batch
that share an image whatever their adapters, and its output can be kept for the next request with that image.
Nothing is trained through it either, so its attention needs no memory-saving backward.

Dtypes as the text layers: matmuls in the weights' dtype with float32 accumulation, norms, rope, softmax and the
residual stream in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...lora import base_matmul
from ...rope import apply_rope
from .vision_config import VisionConfig, VisionInputs

# Queries per attention block: a block's [heads, QUERY_BLOCK, patches] float32 scores are live at a time, so memory
# grows linearly with the patches of a call (a 16M-pixel image is 65,536 patches).
QUERY_BLOCK = 512


class Linear(nnx.Module):
    """y = x @ kernel + bias; kernel [in, out] (the checkpoint's weight transposed)."""

    def __init__(self, in_features: int, out_features: int, param_dtype=jnp.float32):
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return base_matmul(x, self.kernel[...]) + self.bias[...].astype(jnp.float32)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]


class PatchEmbed(nnx.Module):
    """The Conv3d whose kernel and stride are one patch: a linear map of each patch row (module docstring)."""

    def __init__(self, config: VisionConfig, param_dtype=jnp.float32):
        self.proj = Linear(config.patch_dim, config.hidden_size, param_dtype)

    def __call__(self, patches: jax.Array) -> jax.Array:
        return self.proj(patches)


class PositionTable(nnx.Module):
    """The learned square table of position embeddings [grid_side**2, hidden] (transformers' `pos_embed`)."""

    def __init__(self, config: VisionConfig, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.zeros((config.num_position_embeddings, config.hidden_size), param_dtype))

    def __call__(self, index: jax.Array, weight: jax.Array) -> jax.Array:
        """Each patch's embedding, bilinearly resampled to its image's grid: the four taps `index` [N, 4] summed
        with `weight` [N, 4]."""
        rows = jnp.take(self.weight[...], index, axis=0).astype(jnp.float32)  # [N, 4, hidden]
        return jnp.sum(rows * weight[..., None], axis=1)


def rope_tables(config: VisionConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [N, head_dim] of the axial 2-D rope: the first quarter of each half turns with the patch's row, the
    second with its column (transformers' `Qwen3_5VisionRotaryEmbedding`, rotate-half layout)."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(config.inv_freq())  # [N, 2, head_dim // 4]
    half = freqs.reshape(positions.shape[0], -1)  # rows' frequencies, then columns'
    emb = jnp.concatenate([half, half], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def segment_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, block: int = QUERY_BLOCK
) -> jax.Array:
    """Bidirectional attention within segments: q/k/v [N, H, D] in the compute dtype, `segments` int32 [N] (0:
    padding, which answers zero). Float32 [N, H, D]. Queries go `block` at a time against every key, each block's
    softmax exact (no online rescaling), scores float32 and probabilities cast to the compute dtype for P @ V (as
    transformers' eager attention)."""
    n, h, d = q.shape
    bq = min(block, n)
    blocks = -(-n // bq)
    pad = blocks * bq - n
    q_blocks = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(blocks, bq, h, d)
    seg_blocks = jnp.pad(segments, (0, pad)).reshape(blocks, bq)

    def one(args):
        qb, sb = args
        scores = jnp.einsum("qhd,khd->hqk", qb, k, preferred_element_type=jnp.float32) * (d**-0.5)
        seen = (sb[:, None] == segments[None, :]) & (sb[:, None] > 0)  # [bq, N]
        scores = jnp.where(seen[None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("hqk,khd->qhd", probs, v, preferred_element_type=jnp.float32)
        return jnp.where((sb > 0)[:, None, None], out, 0.0)

    return jax.lax.map(one, (q_blocks, seg_blocks)).reshape(blocks * bq, h, d)[:n]


class VisionAttention(nnx.Module):
    def __init__(self, config: VisionConfig, param_dtype=jnp.float32):
        self.config = config
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, param_dtype)
        self.proj = Linear(config.hidden_size, config.hidden_size, param_dtype)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], segments: jax.Array) -> jax.Array:
        c = self.config
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, c.num_heads, c.head_dim)
        cos, sin = rope
        # apply_rope takes [B, T, H, D] and tables [B, T, D]: this call's patches are one row
        q, k = (apply_rope(qkv[None, :, i], cos[None], sin[None])[0] for i in (0, 1))
        cd = self.qkv.kernel[...].dtype
        out = segment_attention(q.astype(cd), k.astype(cd), qkv[:, 2].astype(cd), segments)
        return self.proj(out.reshape(n, c.hidden_size))


class VisionMLP(nnx.Module):
    def __init__(self, config: VisionConfig, param_dtype=jnp.float32):
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, param_dtype)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, param_dtype)
        self.tanh = config.tanh_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=self.tanh))


class VisionBlock(nnx.Module):
    def __init__(self, config: VisionConfig, param_dtype=jnp.float32):
        self.norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.attn = VisionAttention(config, param_dtype)
        self.mlp = VisionMLP(config, param_dtype)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], segments: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """merge_unit consecutive patches (one merge block) -> one feature of out_hidden_size. `postshuffle_norm`
    (Qwen3-VL's DeepStack mergers) normalises the concatenated block instead of each patch."""

    def __init__(self, config: VisionConfig, *, postshuffle_norm: bool = False, param_dtype=jnp.float32):
        merged = config.hidden_size * config.merge_unit
        self.norm = LayerNorm(merged if postshuffle_norm else config.hidden_size, config.layer_norm_eps)
        self.linear_fc1 = Linear(merged, merged, param_dtype)
        self.linear_fc2 = Linear(merged, config.out_hidden_size, param_dtype)
        self.postshuffle_norm = postshuffle_norm
        self.merged = merged

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle_norm else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))  # nn.GELU(): the exact erf form


class VisionModel(nnx.Module):
    def __init__(self, config: VisionConfig, param_dtype=jnp.float32):
        self.config = config
        self.patch_embed = PatchEmbed(config, param_dtype)
        self.pos_embed = PositionTable(config, param_dtype)
        self.blocks = nnx.List([VisionBlock(config, param_dtype) for _ in range(config.depth)])
        self.merger = PatchMerger(config, param_dtype=param_dtype)
        self.deepstack_merger_list = nnx.List(
            [
                PatchMerger(config, postshuffle_norm=True, param_dtype=param_dtype)
                for _ in config.deepstack_visual_indexes
            ]
        )

    def __call__(self, patches: jax.Array, inputs: VisionInputs) -> tuple[jax.Array, list[jax.Array]]:
        """`patches` [N, patch_dim] (the image processor's rows, padded to N, a multiple of merge_unit) ->
        features float32 [N / merge_unit, out_hidden_size], one per merge block in patch order (padding blocks
        hold values to be ignored), and the DeepStack features of the same shape (an empty list for Qwen3.5)."""
        segments = jnp.asarray(inputs.segments)
        x = self.patch_embed(patches) + self.pos_embed(inputs.interp_index, inputs.interp_weight)
        rope = rope_tables(self.config, jnp.asarray(inputs.positions))
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, segments)
            if i in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
