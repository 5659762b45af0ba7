"""Per-slot AdamW over the adapter-axis LoRA state, with torch.optim.AdamW semantics.

Moments and the step counter keep the adapter axis; a step slices one slot, runs optax's AdamW on it (bias
correction, decoupled weight decay lr*wd*p, eps outside the sqrt, exactly torch's update) and writes only that slot
back, so stepping or decaying one adapter never touches another. Hyper-parameters are traced scalars, so one
compile serves every learning rate and every slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .lora import is_a_leaf, module_kind

_KIND_INDEX = {"attn": 0, "mlp": 1, "unembed": 2}


@jax.tree_util.register_dataclass
@dataclass
class AdamHparams:
    learning_rate: jax.Array
    beta1: jax.Array
    beta2: jax.Array
    eps: jax.Array
    weight_decay: jax.Array
    grad_clip_norm: jax.Array  # <= 0: no clipping


@jax.tree_util.register_dataclass
@dataclass
class SlotShape:
    """What of a slot may be non-zero: its rank and which module groups (attn, mlp, unembed) it trains."""

    rank: jax.Array  # int32 []
    trained: jax.Array  # float32 [3]


@jax.tree_util.register_dataclass
@dataclass
class OptState:
    mu: Any  # like the LoRA state, adapter axis first
    nu: Any
    count: jax.Array  # int32 [S]

    @classmethod
    def zeros_like(cls, lora: Any) -> "OptState":
        zeros = jax.tree.map(jnp.zeros_like, lora)
        num_slots = jax.tree.leaves(lora)[0].shape[0]
        return cls(mu=zeros, nu=jax.tree.map(jnp.zeros_like, lora), count=jnp.zeros((num_slots,), jnp.int32))


def slot_masks(lora_slot: Any, shape: SlotShape) -> Any:
    """Per leaf: 1 where the slot's parameter is live (within rank, in a trained module group), else 0."""

    def mask(path, x):
        flag = shape.trained[_KIND_INDEX[module_kind(path)]]
        if is_a_leaf(path):  # [in, R]
            live = (jnp.arange(x.shape[-1]) < shape.rank)[None, :]
        else:  # [R, out]
            live = (jnp.arange(x.shape[0]) < shape.rank)[:, None]
        return jnp.broadcast_to(live.astype(x.dtype) * flag, x.shape)

    return jax.tree_util.tree_map_with_path(mask, lora_slot)


def clip_by_global_norm_torch(grads: Any, max_norm: jax.Array) -> tuple[Any, jax.Array]:
    """torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)); max_norm <= 0 disables."""
    norm = optax.tree.norm(grads)
    coef = jnp.where(max_norm > 0, jnp.minimum(1.0, max_norm / (norm + 1e-6)), 1.0)
    return jax.tree.map(lambda g: g * coef, grads), norm


@partial(jax.jit, donate_argnames=("lora", "grads", "opt"))
def adamw_slot_step(lora: Any, grads: Any, opt: OptState, slot: jax.Array, hp: AdamHparams, shape: SlotShape):
    """One AdamW step of `slot`; returns (lora, grads with the slot zeroed, opt, grad_norm before clipping)."""
    take = lambda tree: jax.tree.map(lambda x: x[slot], tree)  # noqa: E731
    params, g = take(lora), take(grads)
    masks = slot_masks(params, shape)
    g = jax.tree.map(jnp.multiply, g, masks)
    g, grad_norm = clip_by_global_norm_torch(g, hp.grad_clip_norm)

    tx = optax.adamw(hp.learning_rate, b1=hp.beta1, b2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay)
    state = optax.tree_utils.tree_set(tx.init(params), mu=take(opt.mu), nu=take(opt.nu), count=opt.count[slot])
    updates, state = tx.update(g, state, params)
    # Re-mask so out-of-rank columns and untrained groups stay exactly zero whatever the arithmetic did.
    params = jax.tree.map(jnp.multiply, optax.apply_updates(params, updates), masks)

    put = lambda tree, value: jax.tree.map(lambda x, v: x.at[slot].set(v), tree, value)  # noqa: E731
    new_opt = OptState(
        mu=put(opt.mu, optax.tree_utils.tree_get(state, "mu")),
        nu=put(opt.nu, optax.tree_utils.tree_get(state, "nu")),
        count=opt.count.at[slot].set(optax.tree_utils.tree_get(state, "count")),
    )
    grads = jax.tree.map(lambda x: x.at[slot].set(0.0), grads)
    return put(lora, params), grads, new_opt, grad_norm
