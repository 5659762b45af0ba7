"""The engine's trainable state: `max_lora_adapters` LoRA slots, their gradient accumulators and optimizer moments.

Every LoRA-shaped tree here carries the adapter axis first (slot i is `tree[i]`), sharded by the placement; a slot
is written and zeroed by one jitted update of the whole tree (one compile, in place, shardings kept), so a slot's
bookkeeping never touches another slot's values. This module holds which slots are allocated and with what
`LoraConfig`, and the named, rank-trimmed view of a slot (`layers.0.mlp.up_proj.lora_a` -> [in, rank]) that export,
import and checkpoints use. With stacked layers (decoder.DecoderStack) a slot's leaf `layers.mlp.up_proj.lora_a` is
[L, in, R]; its layer i is named `layers.{i}.mlp.up_proj.lora_a` as in the per-layer layout, so names (and every file
format built on them) do not depend on the layout. Training (`trainer.py`) and snapshots (`snapshots.py`) read and
write these trees.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..model.lora import LORA_ALPHA, init_a, is_a_leaf, is_stacked_layer, module_kind
from ..model.sharding import DeviceLayout
from ..types import InputError, LoraConfig, SlotState
from .optimizer import OptState


def leaf_name(path: tuple) -> str:
    """A tree path as the dotted module name of its leaf (e.g. "layers.0.mlp.up_proj.lora_a")."""
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    return ".".join(str(k) for k in keys if k != "value")


def leaf_parts(path: tuple, slot_shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The module names within one slot's leaf (shape without the adapter axis) and the index of each: the leaf
    itself, or each layer of a stacked leaf."""
    name = leaf_name(path)
    if not is_stacked_layer(path):
        return [(name, ())]
    rest = name.split("layers.", 1)[1]
    return [(f"layers.{i}.{rest}", (i,)) for i in range(slot_shape[0])]


def trained_groups(config: LoraConfig) -> dict[str, bool]:
    return {"attn": config.train_attn, "mlp": config.train_mlp, "unembed": config.train_unembed}


class AdapterSlots:
    """LoRA weights, gradients and optimizer state of every slot, and which slots are allocated (see module doc)."""

    def __init__(self, lora: Any, placement: DeviceLayout, *, max_adapters: int, max_rank: int):
        self.placement = placement
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.lora = self.put_lora(lora)
        self.grads = self.put_lora(jax.tree.map(jnp.zeros_like, self.lora))
        self.opt = self.put_opt(OptState.zeros_like(self.lora))
        self.configs: dict[int, LoraConfig] = {}

        def write_slot(tree, slot, values):
            written = jax.tree.map(lambda x, v: x.at[slot].set(v.astype(x.dtype)), tree, values)
            return placement.constrain_params(written)

        def zero_slot(tree, slot):
            # Any pytree whose leaves carry the adapter axis first (LoRA-shaped trees, OptState with its counts).
            out = jax.tree.map(lambda x: x.at[slot].set(jnp.zeros((), x.dtype)), tree)
            if isinstance(out, OptState):
                return OptState(
                    mu=placement.constrain_params(out.mu),
                    nu=placement.constrain_params(out.nu),
                    count=jax.lax.with_sharding_constraint(out.count, placement.replicated),
                )
            return placement.constrain_params(out)

        self.write_slot = jax.jit(write_slot, donate_argnums=0)
        self.zero_slot = jax.jit(zero_slot, donate_argnums=0)
        # Indexing copies: what it returns does not change when the slot is trained later (snapshots rely on it).
        self.take_slot = jax.jit(lambda tree, slot: jax.tree.map(lambda x: x[slot], tree))

    # ------------------------------------------------------------------ checks

    def check_slot(self, slot: int, *, allocated: bool = True) -> None:
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.max_adapters):
            raise InputError(f"adapter slot {slot} out of range [0, {self.max_adapters})")
        if allocated and slot not in self.configs:
            raise InputError(f"adapter slot {slot} is not allocated")

    def check_rank(self, config: LoraConfig) -> None:
        if not (1 <= config.rank <= self.max_rank):
            raise InputError(f"LoRA rank {config.rank} must be in [1, {self.max_rank}] (max_lora_rank)")

    def scale(self, slot: int) -> float:
        return LORA_ALPHA / self.configs[slot].rank

    # ------------------------------------------------------------------ placement

    def put_lora(self, tree: Any) -> Any:
        """LoRA-shaped state (weights, gradients, moments) on its shardings; a no-op when already there."""
        return self.placement.put_params(tree)

    def put_opt(self, opt: OptState) -> OptState:
        return OptState(
            mu=self.put_lora(opt.mu), nu=self.put_lora(opt.nu), count=self.placement.put_replicated(opt.count)
        )

    # ------------------------------------------------------------------ allocation

    def create(self, slot: int, config: LoraConfig) -> None:
        self.check_slot(slot, allocated=False)
        self.check_rank(config)
        rng = np.random.default_rng(config.seed if config.seed is not None else secrets.randbits(63))
        trained = trained_groups(config)

        def init(path, leaf):
            # A random (PEFT's kaiming-uniform) in trained groups, B zero: the fresh adapter equals the base model.
            out = np.zeros(leaf.shape[1:], np.float32)
            if not (is_a_leaf(path) and trained[module_kind(path)]):
                return out
            for _, index in leaf_parts(path, out.shape):  # each layer of a stacked leaf
                *experts, in_features, max_rank = out[index].shape  # MoE expert A: [E, in, R], one draw per expert
                if experts:
                    out[index] = np.stack([init_a(rng, in_features, config.rank, max_rank) for _ in range(experts[0])])
                else:
                    out[index] = init_a(rng, in_features, config.rank, max_rank)
            return out

        values = jax.tree_util.tree_map_with_path(init, self.lora)
        self.lora = self.write_slot(self.lora, np.int32(slot), values)
        self.zero_training_state(slot)
        self.configs[slot] = config

    def free(self, slot: int) -> None:
        self.check_slot(slot, allocated=False)
        self.lora = self.zero_slot(self.lora, np.int32(slot))
        self.zero_training_state(slot)
        self.configs.pop(slot, None)

    def zero_training_state(self, slot: int) -> None:
        self.grads = self.zero_slot(self.grads, np.int32(slot))
        self.opt = self.zero_slot(self.opt, np.int32(slot))

    # ------------------------------------------------------------------ named weights, export and import

    def named(self, tree: Any, slot: int) -> dict[str, np.ndarray]:
        """Slot `slot` of a LoRA-shaped tree by module name, trimmed to the slot's rank, on the host."""
        self.check_slot(slot)
        rank = self.configs[slot].rank
        out = {}
        host = self.placement.to_host(self.take_slot(tree, np.int32(slot)))  # one gather, also across hosts
        for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
            for name, index in leaf_parts(path, np.shape(leaf)):
                arr = np.asarray(leaf)[index]
                out[name] = arr[..., :rank] if is_a_leaf(path) else arr[..., :rank, :]
        return out

    def set_weights(self, slot: int, weights: dict[str, np.ndarray]) -> None:
        """Overwrite an allocated slot's LoRA weights (names and rank-trimmed shapes as `named` gives them)."""
        self.check_slot(slot)
        rank = self.configs[slot].rank
        current = self.named(self.lora, slot)
        unknown = sorted(set(weights) - set(current))
        if unknown:
            raise InputError(f"unknown LoRA weights {unknown[:3]}")
        for name, value in weights.items():
            if np.shape(value) != current[name].shape:
                raise InputError(f"{name}: shape {np.shape(value)} != {current[name].shape} (rank {rank})")

        current_full = {
            leaf_name(p): np.array(x)
            for p, x in jax.tree_util.tree_flatten_with_path(
                self.placement.to_host(self.take_slot(self.lora, np.int32(slot)))
            )[0]
        }

        def put(path, leaf):
            full = current_full[leaf_name(path)]
            for name, index in leaf_parts(path, full.shape):
                value = weights.get(name)
                if value is None:
                    continue
                part = np.zeros(full[index].shape, np.float32)
                if is_a_leaf(path):
                    part[..., :rank] = value
                else:
                    part[..., :rank, :] = value
                full[index] = part
            return full

        self.lora = self.write_slot(self.lora, np.int32(slot), jax.tree_util.tree_map_with_path(put, self.lora))

    def export(self, slot: int) -> SlotState:
        """The slot's config, weights, optimizer moments and step, named and trimmed like `named`."""
        self.check_slot(slot)
        return SlotState(
            config=self.configs[slot],
            weights=self.named(self.lora, slot),
            mu=self.named(self.opt.mu, slot),
            nu=self.named(self.opt.nu, slot),
            step=int(np.asarray(self.opt.count)[slot]),
        )

    def import_(self, slot: int, state: SlotState, *, optimizer: bool) -> LoraConfig:
        """(Re)configure `slot` (allocated or not) as `state`: its weights, and its optimizer moments and step when
        `optimizer` (else zero moments, step 0); the gradient accumulator is zeroed. Missing tensors are zero. An
        allocated slot keeps its optimizer family (with `optimizer`, the state's must be the same). Every check runs
        before anything is written. Returns the slot's config as it now is."""
        self.check_slot(slot, allocated=False)
        self.check_rank(state.config)
        if slot in self.configs:  # an allocated slot keeps its optimizer: fixed for the run's life
            family = self.configs[slot].optimizer
            if optimizer and state.config.optimizer != family:
                raise InputError(
                    f"the checkpoint holds {state.config.optimizer} optimizer state, but this training run was "
                    f"created with {family}, which stays fixed for its lifetime; load the weights without the "
                    "optimizer state, or create a training client from the checkpoint"
                )
            state = replace(state, config=replace(state.config, optimizer=family))
        weights = self.full(state.config, state.weights, "weights")
        moments = None
        if optimizer:
            if not (isinstance(state.step, (int, np.integer)) and 0 <= state.step < 2**31):
                raise InputError(f"optimizer step {state.step!r} must be an integer in [0, 2**31)")
            moments = self.full(state.config, state.mu, "mu"), self.full(state.config, state.nu, "nu")
        self.lora = self.write_slot(self.lora, np.int32(slot), weights)
        self.zero_training_state(slot)
        if moments is not None:
            s, (mu, nu) = np.int32(slot), moments
            self.opt = self.put_opt(
                OptState(
                    mu=self.write_slot(self.opt.mu, s, mu),
                    nu=self.write_slot(self.opt.nu, s, nu),
                    count=self.opt.count.at[slot].set(int(state.step)),
                )
            )
        self.configs[slot] = state.config
        return state.config

    def full(self, config: LoraConfig, named: dict[str, np.ndarray], what: str) -> Any:
        """Named rank-trimmed tensors as one slot's full LoRA-shaped tree (numpy, no adapter axis), zero beyond the
        rank and wherever a name is missing; InputError for unknown names, wrong shapes, non-finite values, or
        non-zero values in a module group the config does not train."""
        trained = trained_groups(config)
        rank = config.rank
        paths = jax.tree_util.tree_flatten_with_path(self.lora)[0]
        known = {name for p, leaf in paths for name, _ in leaf_parts(p, leaf.shape[1:])}
        unknown = sorted(set(named) - known)
        if unknown:
            raise InputError(f"unknown LoRA {what} {unknown[:3]}")

        def full(path, leaf):
            out = np.zeros(leaf.shape[1:], np.float32)
            for name, index in leaf_parts(path, out.shape):
                if named.get(name) is None:
                    continue
                value, part = np.asarray(named[name]), out[index]  # part: a view into out
                expected = (*part.shape[:-1], rank) if is_a_leaf(path) else (*part.shape[:-2], rank, part.shape[-1])
                if value.shape != expected:
                    raise InputError(f"{what} {name}: shape {value.shape} != {expected} for rank {rank}")
                if not np.all(np.isfinite(value)):
                    raise InputError(f"{what} {name}: non-finite values")
                if not trained[module_kind(path)] and np.any(value):
                    raise InputError(f"{what} {name}: non-zero, but its {module_kind(path)} group is not trained")
                if is_a_leaf(path):
                    part[..., :rank] = value
                else:
                    part[..., :rank, :] = value
            return out

        return jax.tree_util.tree_map_with_path(full, self.lora)
