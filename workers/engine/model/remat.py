"""Gradient checkpointing (rematerialisation) of the decoder layers, at one of three levels.

* `Remat.NONE`: nothing recomputed; the backward pass reads every intermediate the forward kept (the most memory).
* `Remat.DOTS`: `jax.checkpoint` with a policy that keeps the matmul outputs of each layer (`PROJECTION`: every
  LoRALinear's output, q/k/v/o and gate/up/down, base GEMM plus LoRA product; `LORA_DOWN`: each x @ A; `ATTENTION`:
  the blockwise attention's output and log-sum-exp) and recomputes only the elementwise work between them (norms,
  rope, the casts, SiLU * up, the residual adds). The backward runs no forward GEMM again.
* `Remat.FULL`: `jax.checkpoint` saving nothing but the layer's input: the whole layer, GEMMs included, runs again in
  the backward pass (the least memory; on a Qwen3-8B LoRA step about a third of the work).

Why names (a `save_only_these_names`-style policy over `checkpoint_name`s) and not
`dots_with_no_batch_dims_saveable`: that policy keys on the dot primitive, and ours are not alike. The base GEMM
(lora.base_matmul, a custom VJP) is a dot without batch dimensions, but the LoRA products are batched einsums (each
row gathers its slot's A and B), which that policy never saves, so every projection's output (base + LoRA) would
still be recomputed through its LoRA product; the attention's dots are batched too, and `dots_saveable` instead
would keep the blockwise attention's per-block scores (quadratic in length). Naming the values keeps exactly what
the backward reads (the sums the norms, rope and SiLU read, each x @ A, the attention's output and log-sum-exp),
nothing quadratic, the fused kernels' outputs by primitive (their residuals cannot be named from here). The base
GEMM's own backward needs its input cast to the weight dtype, which is recomputed elementwise from saved values.

The values are saved as they are computed: the projections accumulate in float32 (preferred_element_type), so they
are kept in float32. Keeping them in the compute dtype would round values that NONE does not round, and DOTS would
no longer give NONE's gradients exactly; the memory plan counts them at 4 bytes (runtime/memory_plan.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# What DOTS keeps (see the module doc). Outside a checkpoint a name is an identity that XLA drops.
PROJECTION = "projection"
LORA_DOWN = "lora_down"
ATTENTION = "attention"

# The fused attention kernels' forward primitives (model/fused_attention.py): their outputs (the attention output and
# its softmax statistics, O(T), the residuals of their own backward) cannot be named from here, so DOTS keeps them by
# primitive; in a train step the only Pallas calls are attention kernels.
ATTENTION_KERNELS = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd", "pallas_call"})


@dataclass(frozen=True)
class _SaveMatmulOutputs:
    """Remat.DOTS's policy: save our named values and the fused attention kernels' outputs; recompute the rest."""

    names: frozenset[str]

    def __call__(self, prim, *_, **params) -> bool:
        if prim.name == "name":  # checkpoint_name's primitive
            return params["name"] in self.names
        return prim.name in ATTENTION_KERNELS


DOTS_POLICY = _SaveMatmulOutputs(frozenset({PROJECTION, LORA_DOWN, ATTENTION}))


class Remat(enum.Enum):
    """How much of a layer the backward pass recomputes (module doc). Ordered by memory: NONE > DOTS > FULL."""

    NONE = "none"
    DOTS = "dots"
    FULL = "full"

    @staticmethod
    def of(value: Remat | bool | str | None) -> Remat:
        """A level from what callers pass: a level, its name, or the old bool (True: FULL, False/None: NONE)."""
        if isinstance(value, Remat):
            return value
        if isinstance(value, str):
            return Remat(value.lower())
        return Remat.FULL if value else Remat.NONE


def checkpoint(fn: Callable[..., Any], level: Remat, **options: Any) -> Callable[..., Any]:
    """`fn` under `level`'s checkpointing (NONE: `fn` itself); `options` go to `jax.checkpoint`."""
    if level is Remat.NONE:
        return fn
    if level is Remat.DOTS:
        return jax.checkpoint(fn, policy=DOTS_POLICY, **options)
    return jax.checkpoint(fn, **options)


def checkpointed(level: Remat, layer: nnx.Module, call, *args):
    """Gradient checkpointing of one layer at `level` (module doc): keep its inputs (and at DOTS its matmul outputs),
    recompute the rest of `call(layer, *args)` in the backward pass; NONE calls it plainly.

    A pure `jax.checkpoint` over the layer's split state (the layer is already a traced value inside the step's
    grad, which `nnx.remat` would try to update in place). Every family's per-layer loop checkpoints through this."""
    graphdef, state = nnx.split(layer)

    def run(state, *args):
        return call(nnx.merge(graphdef, state), *args)

    return checkpoint(run, level)(state, *args)


__all__ = [
    "ATTENTION",
    "DOTS_POLICY",
    "LORA_DOWN",
    "PROJECTION",
    "Remat",
    "checkpoint",
    "checkpoint_name",
    "checkpointed",
]
