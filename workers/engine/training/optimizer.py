"""Per-slot AdamW over the adapter-axis LoRA state, with torch.optim.AdamW semantics.

Moments and the step counter keep the adapter axis; a step slices one slot out of every buffer
(`lax.dynamic_slice` at a traced slot index), runs optax's AdamW on that slice (bias correction, decoupled weight
decay lr*wd*p, eps outside the sqrt, exactly torch's update) and writes only that slice back
(`lax.dynamic_update_slice`), so stepping or decaying one adapter never touches another.

The step is two jitted calls: `adamw_slot_values` only reads (it returns the slot's new weights, moments and
metrics, all slot-sized), and `write_slot_values` only writes, with the LoRA weights, the gradient accumulator and
the moments donated, so XLA updates them in place. In one computation XLA fuses the slot reads into the other
buffers' updates and then copies whole multi-slot buffers to keep their old values alive (the slot's weight update
reads the moments that the moment update overwrites); split, a step touches one slot's worth of memory.
Hyper-parameters, the slot, its rank and its trained module groups are traced, so each half compiles once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..model.lora import is_a_leaf, module_kind

if TYPE_CHECKING:
    from ..model.sharding import DeviceLayout

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
    def zeros_like(cls, lora: Any) -> OptState:
        zeros = jax.tree.map(jnp.zeros_like, lora)
        num_slots = jax.tree.leaves(lora)[0].shape[0]
        return cls(mu=zeros, nu=jax.tree.map(jnp.zeros_like, lora), count=jnp.zeros((num_slots,), jnp.int32))


def slot_masks(lora_slot: Any, shape: SlotShape) -> Any:
    """Per leaf: 1 where the slot's parameter is live (within rank, in a trained module group), else 0."""

    def mask(path, x):
        flag = shape.trained[_KIND_INDEX[module_kind(path)]]
        if is_a_leaf(path):  # [in, R] (MoE experts: [E, in, R])
            live = (jnp.arange(x.shape[-1]) < shape.rank)[None, :]
        else:  # [R, out] (MoE experts: [E, R, out]): the rank axis is the second to last
            live = (jnp.arange(x.shape[-2]) < shape.rank)[:, None]
        return jnp.broadcast_to(live.astype(x.dtype) * flag, x.shape)

    return jax.tree_util.tree_map_with_path(mask, lora_slot)


def clip_by_global_norm_torch(grads: Any, max_norm: jax.Array) -> tuple[Any, jax.Array]:
    """torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)); max_norm <= 0 disables."""
    norm = optax.tree.norm(grads)
    coef = jnp.where(max_norm > 0, jnp.minimum(1.0, max_norm / (norm + 1e-6)), 1.0)
    return jax.tree.map(lambda g: g * coef, grads), norm


def take_slot(x: jax.Array, slot: jax.Array) -> jax.Array:
    """x[slot] for a traced slot: a dynamic_slice of one adapter row (no gather)."""
    start = (slot,) + (jnp.zeros((), slot.dtype),) * (x.ndim - 1)
    return jax.lax.dynamic_slice(x, start, (1, *x.shape[1:]))[0]


def put_slot(x: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """x.at[slot].set(value) as a dynamic_update_slice, which XLA does in place on a donated buffer."""
    start = (slot,) + (jnp.zeros((), slot.dtype),) * (x.ndim - 1)
    return jax.lax.dynamic_update_slice(x, jnp.asarray(value, x.dtype)[None], start)


def pack_hparams(values: tuple[float, ...], rank: int, trained: tuple[bool, bool, bool]) -> np.ndarray:
    """(lr, beta1, beta2, eps, weight_decay, grad_clip_norm), the rank and the three trained flags as one float32
    vector, so a step's hyper-parameters travel to the device as one small array."""
    return np.asarray([*values, rank, *trained], np.float32)


def unpack_hparams(packed: jax.Array) -> tuple[AdamHparams, SlotShape]:
    hp = AdamHparams(*(packed[i] for i in range(6)))
    return hp, SlotShape(rank=packed[6].astype(jnp.int32), trained=packed[7:10])


def adamw_slot_math(params: Any, g: Any, mu: Any, nu: Any, count: jax.Array, hp: AdamHparams, shape: SlotShape):
    """One AdamW step on one slot's slices; returns (params, mu, nu, count, grad_norm before clipping)."""
    masks = slot_masks(params, shape)
    g = jax.tree.map(jnp.multiply, g, masks)
    g, grad_norm = clip_by_global_norm_torch(g, hp.grad_clip_norm)

    tx = optax.adamw(hp.learning_rate, b1=hp.beta1, b2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay)
    state = optax.tree_utils.tree_set(tx.init(params), mu=mu, nu=nu, count=count)
    updates, state = tx.update(g, state, params)
    # Re-mask so out-of-rank columns and untrained groups stay exactly zero whatever the arithmetic did.
    params = jax.tree.map(jnp.multiply, optax.apply_updates(params, updates), masks)
    get = partial(optax.tree_utils.tree_get, state)
    return params, get("mu"), get("nu"), get("count"), grad_norm


@jax.jit
def adamw_slot_values(lora: Any, grads: Any, opt: OptState, slot: jax.Array, packed: jax.Array):
    """Read-only half of a step: `slot`'s new weights, mu and nu without the adapter axis, as flat leaf lists in
    the LoRA tree's order (no pytree nodes to rebuild on the host), its new step count, and metrics float32
    [grad_norm before clipping, step, 1.0 if the new weights and moments are all finite else 0.0]. `packed` comes
    from pack_hparams."""
    hp, shape = unpack_hparams(packed)
    take = lambda tree: jax.tree.map(lambda x: take_slot(x, slot), tree)  # noqa: E731
    params, mu, nu, count, grad_norm = adamw_slot_math(
        take(lora), take(grads), take(opt.mu), take(opt.nu), take_slot(opt.count, slot), hp, shape
    )
    # 1.0 when every new weight and moment is finite: the engine writes the step only then (a run never goes NaN).
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((params, mu, nu))]))
    metrics = jnp.stack([grad_norm.astype(jnp.float32), count.astype(jnp.float32), finite.astype(jnp.float32)])
    return (jax.tree.leaves(params), jax.tree.leaves(mu), jax.tree.leaves(nu)), count, metrics


@partial(jax.jit, static_argnames=("placement",), donate_argnames=("lora", "grads", "opt"))
def write_slot_values(
    lora: Any,
    grads: Any,
    opt: OptState,
    slot: jax.Array,
    values: tuple[list, list, list],
    count: jax.Array,
    *,
    placement: DeviceLayout | None = None,
):
    """Write-only half: `slot`'s weights, moments (`values` from adamw_slot_values) and step count set and its
    gradient accumulator zeroed, in place on the donated buffers; with a placement, outputs keep its shardings."""

    def put(tree, leaves):
        flat, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [put_slot(x, slot, v) for x, v in zip(flat, leaves, strict=True)])

    lora, mu, nu = (put(tree, leaves) for tree, leaves in zip((lora, opt.mu, opt.nu), values))
    grads = jax.tree.map(lambda x: put_slot(x, slot, jnp.zeros(x.shape[1:], x.dtype)), grads)
    count = put_slot(opt.count, slot, count)
    if placement is not None:
        lora, grads, mu, nu = (placement.constrain_params(t) for t in (lora, grads, mu, nu))
        count = jax.lax.with_sharding_constraint(count, placement.replicated)
    return lora, grads, OptState(mu=mu, nu=nu, count=count)


def adamw_slot_step(
    lora: Any, grads: Any, opt: OptState, slot: Any, packed: Any, placement: DeviceLayout | None = None
):
    """One AdamW step of `slot` (lora, grads and opt are donated); returns (lora, grads with the slot zeroed, opt,
    metrics float32 [grad_norm before clipping, step]) with the metrics still on the device."""
    values, count, metrics = adamw_slot_values(lora, grads, opt, slot, packed)
    lora, grads, opt = write_slot_values(lora, grads, opt, slot, values, count, placement=placement)
    return lora, grads, opt, metrics
