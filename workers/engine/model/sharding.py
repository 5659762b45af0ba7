"""The device mesh (`fsdp` x `tp`, plus `ep` for mixture-of-experts models) and where every array lives on it.

One `MeshConfig` says how many devices go on each axis. Parameters are placed by their role:

* column-parallel linears (q/k/v/gate/up, kernel [in, out]): out on `tp`, in on `fsdp`;
* row-parallel linears (o/down): in on `tp`, out on `fsdp`;
* LoRA A [S, in, R] / B [S, R, out] follow their base kernel's in / out sharding, the adapter axis unsharded;
* the embedding [V, H]: vocab on `tp`, hidden on `fsdp` (the tied unembedding then gives vocab-parallel logits);
  an untied lm_head kernel [H, V] likewise; norms are replicated;
* stacked decoder layers (decoder.DecoderStack): the layer axis (leading on base leaves, second on LoRA leaves) is
  unsharded, the other axes as above; the KV cache [L, B, S, kv, hd] likewise.

Batches (every array whose leading dimension is the batch) are sharded on `fsdp`; row buckets are rounded up to a
multiple of the fsdp size, and padding rows carry no weight. A model whose shape does not divide the mesh (heads,
kv heads or intermediate size by tp; hidden size by fsdp) is refused at load with a ValueError naming the value.
On one device every sharding is trivial and nothing changes.

Expert parallelism (MoE models, `MeshConfig(ep=N)`, N > 1): a third axis `ep` (mesh (fsdp, ep, tp)). Stacked expert
kernels [E, in, out] put the expert axis on `ep` (in/out as the dense column/row rule), per-expert LoRA A [S, E, in, R]
/ B [S, E, R, out] likewise; everything else is replicated over `ep`, and batches are split over fsdp and ep together
(the ep devices are data-parallel outside the expert block). num_experts must divide by ep. With ep == 1 the mesh
keeps its two axes, so dense models see no change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .families import ModelConfig
from .lora import is_stacked_layer

log = logging.getLogger(__name__)

FSDP, TP, EP = "fsdp", "tp", "ep"
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}


@dataclass(frozen=True)
class MeshConfig:
    """Devices per mesh axis; None for fsdp means "every device not used by tp"."""

    fsdp: int | None = None
    tp: int = 1
    ep: int = 1  # expert-parallel devices (MoE models); the axis exists only when > 1

    def build(self, devices: list | None = None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        if self.tp < 1 or self.ep < 1 or (self.fsdp is not None and self.fsdp < 1):
            raise ValueError(f"mesh axes must be >= 1, got fsdp={self.fsdp} tp={self.tp} ep={self.ep}")
        other = self.tp * self.ep
        fsdp = self.fsdp if self.fsdp is not None else len(devices) // other
        if fsdp < 1 or fsdp * other > len(devices):
            ep = f" x ep={self.ep}" if self.ep > 1 else ""
            raise ValueError(
                f"mesh fsdp={fsdp} x tp={self.tp}{ep} needs {max(fsdp, 1) * other} devices, have {len(devices)}"
            )
        if self.ep > 1:
            return jax.make_mesh(
                (fsdp, self.ep, self.tp),
                (FSDP, EP, TP),
                axis_types=(AxisType.Auto,) * 3,
                devices=devices[: fsdp * other],
            )
        return jax.make_mesh(
            (fsdp, self.tp), (FSDP, TP), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[: fsdp * self.tp]
        )


def as_mesh(mesh: Mesh | MeshConfig | None) -> Mesh:
    """A Mesh from a Mesh, a MeshConfig, or None (all local devices on fsdp, tp=1)."""
    if isinstance(mesh, Mesh):
        if set(mesh.axis_names) not in ({FSDP, TP}, {FSDP, EP, TP}):
            raise ValueError(
                f"mesh axes must be ({FSDP!r}, {TP!r}) or ({FSDP!r}, {EP!r}, {TP!r}), got {mesh.axis_names}"
            )
        return mesh
    return (mesh or MeshConfig()).build()


def check_divisible(config: ModelConfig, mesh: Mesh) -> None:
    """Refuse shapes the mesh cannot split evenly, naming the offending value."""
    fsdp, tp, ep = mesh.shape[FSDP], mesh.shape[TP], mesh.shape.get(EP, 1)
    # ep splits the routed-expert block's expert axis (model/moe.py), whichever family uses it: the experts' count is
    # a generic field of the config, not a question for the family.
    if ep > 1 and not config.num_experts:
        raise ValueError(f"the mesh's ep={ep} needs a mixture-of-experts model; {config.arch} has no experts")
    checks = [
        ("num_experts", config.num_experts, "ep", ep),
        ("moe_intermediate_size", config.moe_intermediate_size, "tp", tp),
        ("num_attention_heads", config.num_heads, "tp", tp),
        ("num_key_value_heads", config.num_kv_heads, "tp", tp),
        ("intermediate_size", config.intermediate_size, "tp", tp),
        ("hidden_size", config.hidden_size, "fsdp", fsdp),
    ]
    for name, value, axis, size in checks:
        if value % size:
            raise ValueError(f"{name}={value} is not divisible by the mesh's {axis}={size}")


def _name(key: Any) -> Any:
    return getattr(key, "key", getattr(key, "name", key))


def param_spec(path: tuple, shape: tuple[int, ...], config: ModelConfig, mesh: Mesh) -> P:
    """The PartitionSpec of one base (Param) or LoRA (LoRAParam) leaf, from its state path."""
    if is_stacked_layer(path):  # one layer's spec with the (unsharded) layer axis put in
        names = [_name(k) for k in path if _name(k) != "value"]
        if names[-1] in ("lora_a", "lora_b"):  # [S, L, ...]
            one = _layer_spec(path, (shape[0], *shape[2:]), config, mesh)
            return P(one[0], None, *one[1:])
        return P(None, *_layer_spec(path, shape[1:], config, mesh))  # [L, ...]
    return _layer_spec(path, shape, config, mesh)


def _layer_spec(path: tuple, shape: tuple[int, ...], config: ModelConfig, mesh: Mesh) -> P:
    names = [_name(k) for k in path if _name(k) != "value"]
    leaf, owner = names[-1], names[-2] if len(names) > 1 else None
    tp = mesh.shape[TP]
    if "experts" in names:  # stacked expert kernels / per-expert LoRA: the expert axis on ep
        expert_axis = EP if mesh.shape.get(EP, 1) > 1 else None
        in_axis, out_axis = (FSDP, TP) if owner in _COLUMN else (TP, FSDP)
        return {
            "kernel": P(expert_axis, in_axis, out_axis),
            "lora_a": P(None, expert_axis, in_axis, None),
            "lora_b": P(None, expert_axis, None, out_axis),
        }[leaf]
    vocab_axis = TP if config.vocab_size % tp == 0 else None
    if owner in _COLUMN or owner in _ROW:
        in_axis, out_axis = (FSDP, TP) if owner in _COLUMN else (TP, FSDP)
    elif owner == "lm_head":
        in_axis, out_axis = FSDP, vocab_axis
    elif owner == "embed_tokens":
        return P(vocab_axis, FSDP)
    else:  # norms
        return P(*([None] * len(shape)))
    if leaf == "kernel":
        return P(in_axis, out_axis)
    if leaf == "lora_a":  # [S, in, R]
        return P(None, in_axis, None)
    if leaf == "lora_b":  # [S, R, out]
        return P(None, None, out_axis)
    raise ValueError(f"no sharding rule for {'.'.join(map(str, names))}")


class DeviceLayout:
    """Shardings of the engine's arrays on one mesh, and helpers to put trees there."""

    def __init__(self, mesh: Mesh, config: ModelConfig):
        check_divisible(config, mesh)
        self.mesh = mesh
        self.config = config
        self.fsdp = mesh.shape[FSDP]
        self.tp = mesh.shape[TP]
        self.ep = mesh.shape.get(EP, 1)
        # Batch rows are split over fsdp (and ep, which is data-parallel outside the experts).
        self._batch_axis = (FSDP, EP) if self.ep > 1 else FSDP
        self.replicated = NamedSharding(mesh, P())
        self._gather = None  # to_host's jitted gather, made on first multi-host use
        if config.vocab_size % self.tp:
            log.info(
                "vocab_size=%d is not divisible by tp=%d: the vocabulary axis stays replicated",
                config.vocab_size,
                self.tp,
            )

    def sharding_of(self, path: tuple, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, param_spec(path, shape, self.config, self.mesh))

    def param_shardings(self, tree: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: NamedSharding(self.mesh, param_spec(path, x.shape, self.config, self.mesh)), tree
        )

    def put_params(self, tree: Any) -> Any:
        return jax.device_put(tree, self.param_shardings(tree))

    def batch_sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, P(self._batch_axis, *([None] * (ndim - 1))))

    def put_batch(self, tree: Any) -> Any:
        """Every leaf's leading dimension is the batch: shard it on fsdp."""
        return jax.device_put(tree, jax.tree.map(lambda x: self.batch_sharding(np.ndim(x)), tree))

    def constrain_batch(self, tree: Any) -> Any:
        """Inside jit: pin batch-leading arrays to the fsdp-sharded layout."""
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.batch_sharding(x.ndim)), tree)

    def cache_sharding(self) -> NamedSharding:
        """KV cache [L, B, S, kv_heads, head_dim]: layers unsharded, rows on fsdp, heads on tp."""
        return NamedSharding(self.mesh, P(None, self._batch_axis, None, TP, None))

    def constrain_params(self, tree: Any) -> Any:
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, self.param_shardings(tree))

    def put_replicated(self, tree: Any) -> Any:
        return jax.device_put(tree, self.replicated)

    def round_rows(self, n: int) -> int:
        """A row count rounded up to a multiple of the fsdp size (so the batch splits evenly)."""
        data = self.fsdp * self.ep
        return -(-n // data) * data

    def to_host(self, tree: Any) -> Any:
        """`jax.device_get`, also for arrays split across processes (multi-host mesh): those are first gathered by
        one jitted identity to a replicated layout, which every process of the mesh must run (they all do: the
        followers replay the same engine calls, multihost.py). With one process this is exactly jax.device_get."""
        leaves = jax.tree.leaves(tree)
        if jax.process_count() == 1 or all(
            not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated for x in leaves
        ):
            return jax.device_get(tree)
        if self._gather is None:
            self._gather = jax.jit(lambda t: t, out_shardings=self.replicated)
        # Host values (numpy, python scalars) go through the identity unchanged, as replicated inputs.
        return jax.device_get(self._gather(tree))
