"""What the shared decoder layers (decoder.py, moe.py) cost one token: the weights its forward pass multiplies through
(the accelerator metrics' model FLOPs, workers/accelerator.py) and the bytes its activations hold (the device-memory
plan, runtime/memory_plan.py). A family adds up its layers with these (families/*/family.py)."""

from __future__ import annotations

from collections.abc import Callable

from .families import ModelConfig


def attention_params(c: ModelConfig) -> int:
    """The attention projections q, k, v, o: H·(nh·hd) + 2·H·(nkv·hd) + (nh·hd)·H."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return c.hidden_size * q + 2 * c.hidden_size * kv + q * c.hidden_size


def swiglu_params(hidden: int, intermediate: int) -> int:
    """A SwiGLU MLP's gate, up and down projections."""
    return 3 * hidden * intermediate


def decoder_params(c: ModelConfig, mlp_params: Callable[[int], int]) -> int:
    """Every layer's attention and MLP (`mlp_params(i)`: layer i's) plus the unembedding H·V (the embedding is a
    lookup, not a matmul)."""
    layers = sum(attention_params(c) + mlp_params(i) for i in range(c.num_layers))
    return layers + c.hidden_size * c.vocab_size


def dense_params(c: ModelConfig) -> int:
    return decoder_params(c, lambda _: swiglu_params(c.hidden_size, c.intermediate_size))


def layer_activation_bytes(c: ModelConfig, mlp_width: int, compute_bytes: int, max_rank: int) -> int:
    """One layer's forward intermediates per token: normed inputs, q/k/v (float32 out of the matmul, then compute
    dtype), attention output, MLP gate/up/activation of `mlp_width` (a routed token: its top-k experts' widths),
    residual adds, and x @ A of every adapted linear. (Measured on an H100, Qwen3-8B bf16, 16K -> 32K tokens, the whole
    training step: 0.98 MB per token, of which 0.59 MB the saved float32 hidden states; the memory plan's formula
    over this gives 1.05 MB.)"""
    f32, h = 4, c.hidden_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    lora = 7 * max_rank * f32
    return (
        (3 * h + 2 * (q + 2 * kv) + q + 3 * mlp_width + 2 * h) * f32 + (q + 2 * kv + mlp_width) * compute_bytes + lora
    )


def saved_matmul_bytes(c: ModelConfig, max_rank: int) -> int:
    """What Remat.DOTS keeps of one dense layer per token (model/remat.py), all float32 as computed: the q, k, v
    and o projections' outputs (nh·hd + 2·nkv·hd + H), the attention's output and log-sum-exp (nh·hd + nh), gate and
    up (2·I; down's output is the next layer's input, kept anyway) and each adapted linear's x @ A (7·R):
    4 · (2·nh·hd + 2·nkv·hd + nh + H + 2·I + 7·R)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return 4 * (2 * q + 2 * kv + c.num_heads + c.hidden_size + 2 * c.intermediate_size + 7 * max_rank)


def dense_activation_bytes(c: ModelConfig, compute_bytes: int, max_rank: int) -> int:
    return layer_activation_bytes(c, c.intermediate_size, compute_bytes, max_rank)
