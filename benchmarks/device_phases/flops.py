"""The FLOP and byte conventions the device check reads its timings by, written once beside the formulas.

N = the base matmul parameters one token's forward pass multiplies through (shapes.matmul_params: the layers'
projections and MLP plus the unembedding; embedding lookups are gathers, not matmuls). P = the adapters' LoRA
parameters (A and B of every target module, the rank the slots were created with). Per token of a training step:

* full fine-tuning convention (`flops_6n`): 6·N, forward 2·N + backward 4·N (activation and weight gradients).
  A LoRA step computes no gradient for the frozen base weights, so this is NOT its model FLOPs: read it only to
  compare with trainers that quote 6·N.
* LoRA model FLOPs (`mfu_lora`): forward 2·N + activation gradient 2·N = 4·N, plus attention (forward 4·hd·nh·L
  per causal token pair, backward twice that: 3x forward) plus the adapters 6·P (forward 2·P, activation gradient
  2·P, their own weight gradient 2·P).
* hardware FLOPs (`hfu`): the model FLOPs plus what gradient checkpointing runs again. The engine's remat is
  `jax.checkpoint` around each decoder layer with the default policy (model/decoder.py: nothing saved), so the
  backward recomputes every layer's forward once: 2·(N - N_unembed) + one more attention forward + 2·P_layers.
  The unembedding and its adapter sit outside the checkpointed layers and are not recomputed. A fused attention
  kernel's own recompute of its softmax in the backward pass is not counted (it is the kernel's choice).

Attention pairs count real tokens only: a sequence of s unpadded tokens has s·(s+1)/2 causal (query, key) pairs;
padding and other packed sequences' tokens are not attended and are not counted.

Decode floor (`floor_ms`): one decode step must read every weight it multiplies through once (the embedding table
excluded unless tied to the unembedding: decode only gathers a row of it) and the KV cache filled so far, at best
at the copy bandwidth measured in this run (bytes read + written over time, env.copy_gb_per_s).
"""

from __future__ import annotations

from collections.abc import Iterable


def causal_pairs(lengths: Iterable[int]) -> int:
    """Real causal (query, key) pairs of unpadded sequences of these lengths."""
    return sum(s * (s + 1) // 2 for s in lengths)


def attention_forward_flops(cfg: dict, pairs: int) -> float:
    """QK^T and PV of every layer and head over `pairs` causal pairs: 2·hd each, per head, per layer."""
    heads, hd, layers = int(cfg["num_attention_heads"]), int(cfg["head_dim"]), int(cfg["num_hidden_layers"])
    return 4.0 * hd * heads * layers * pairs


def unembed_params(cfg: dict) -> int:
    return int(cfg["hidden_size"]) * int(cfg["vocab_size"])


def train_flops(
    cfg: dict,
    n: int,
    lengths: list[int],
    adapter_params: int,
    adapter_unembed_params: int,
    *,
    recomputes: bool = True,
) -> dict:
    """Model and hardware FLOPs of one LoRA forward_backward over sequences of `lengths` tokens (module doc).
    `adapter_params` counts the LoRA parameters one token multiplies through; `adapter_unembed_params` is the
    part of it on the unembedding (not recomputed by remat). `recomputes`: the step ran at Remat.FULL (the layers'
    matmuls and attention forward again); at NONE or DOTS no matmul runs twice and hardware FLOPs are the model's
    (DOTS recomputes elementwise work only, which FLOP counts leave out)."""
    tokens = sum(lengths)
    attention = attention_forward_flops(cfg, causal_pairs(lengths))
    model = tokens * (4.0 * n + 6.0 * adapter_params) + 3.0 * attention
    recompute = tokens * 2.0 * ((n - unembed_params(cfg)) + (adapter_params - adapter_unembed_params)) + attention
    hardware = model + (recompute if recomputes else 0.0)
    return {"flops_6n": 6.0 * n * tokens, "model": model, "hardware": hardware, "attention": attention}


def decode_floor_bytes(weight_bytes: int, embedding_bytes: int, tied: bool, kv_bytes: int) -> int:
    """Bytes one decode step must read at least: the weights once (less the embedding table, gathered only, unless
    the unembedding multiplies through it) and the KV cache filled so far."""
    return weight_bytes - (0 if tied else embedding_bytes) + kv_bytes
