"""Load a Hugging Face checkpoint directory (config.json + safetensors, possibly sharded) into NNX state.

The model is built abstractly (`nnx.eval_shape`), so no random weights are materialised, and each safetensors
tensor is placed straight into its state slot, where the model's family names it (`Family.checkpoint_names`;
`DecoderNames` here for the names the families share). With stacked layers (decoder.DecoderStack, where the family
stacks them) a layer's tensor goes into its row of the stacked host array of that leaf ([L, ...]), which moves to its
device sharding as soon as its last layer is read, so the stacked layout is built once, at load, never per step.
LoRA state starts all zero (every slot == base model).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from .decoder import CausalLM, build_causal_lm
from .families import ModelConfig, StatePath, family_named
from .sharding import DeviceLayout

if TYPE_CHECKING:
    from jax.sharding import Mesh

log = logging.getLogger(__name__)

_LAYER = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$|^model\.layers\.(\d+)\.(\w+layernorm)\.weight$"
)


@dataclass
class LoadedModel:
    config: ModelConfig
    hf_config: dict[str, Any]
    graphdef: nnx.GraphDef
    lora: nnx.State  # LoRAParam leaves, adapter axis first
    base: nnx.State  # frozen Param leaves
    placement: DeviceLayout | None = None  # shardings on the mesh, when loaded onto one


def resolve_model_path(model_path: str) -> str:
    """A local directory as is; otherwise an HF hub id that must already be in the local HF cache (no network)."""
    if os.path.isdir(model_path):
        return os.path.abspath(model_path)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any miss is reported the same way
        raise FileNotFoundError(
            f"model {model_path!r} is neither a local directory nor in the local Hugging Face cache: {e}"
        ) from e


class DecoderNames:
    """The checkpoint names the families share (`CheckpointNames`): the module tree mirrors the checkpoint's, so
    `model.layers.3.self_attn.q_proj.weight` [out, in] is `layers.3.self_attn.q_proj.kernel` [in, out] and a
    norm's `weight` is its `weight`; the embedding, final norm and (untied) lm_head apart. Nothing is stacked from
    pieces: a family whose checkpoint splits a leaf into tensors (per-expert weights) extends `gather`."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def state_path(self, name: str) -> tuple[StatePath, bool] | None:
        if name == "model.embed_tokens.weight":
            return ("embed_tokens", "weight"), False
        if name == "model.norm.weight":
            return ("norm", "weight"), False
        if name == "lm_head.weight":
            # Tied checkpoints sometimes still carry a copy; the embedding is the source of truth then.
            return None if self.config.tie_word_embeddings else (("lm_head", "kernel"), True)
        m = _LAYER.match(name)
        if m is None:
            return None
        if m.group(1) is not None:
            layer, block, leaf = int(m.group(1)), m.group(2), m.group(3)
            if leaf.endswith("_norm"):
                return ("layers", layer, block, leaf, "weight"), False
            return ("layers", layer, block, leaf, "kernel"), True
        return ("layers", int(m.group(4)), m.group(5), "weight"), False

    def gather(self, name: str, read: Callable[[], np.ndarray]) -> bool:
        return False

    def gathered(self) -> Iterator[tuple[StatePath, np.ndarray]]:
        return iter(())


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path}: copy the checkpoint there, or serve random weights of its config's shape "
            "(tinkerflow's --random-weights, for benchmarks)"
        )
    return files


def _get(tree: dict, path: tuple) -> Any:
    node = tree
    for key in path:
        node = node[key]
    return node


def _set(tree: dict, path: tuple, value: Any) -> Any:
    node = tree
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    node[path[-1]] = value
    return old


def load_model(
    model_dir: str,
    *,
    max_adapters: int,
    max_rank: int,
    progress: bool = True,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    remat: bool = False,
    scan_layers: bool = True,
    compute_dtype_residual: bool = False,
) -> LoadedModel:
    """Read the checkpoint into base state (matrices in `dtype`, norms float32) and zero float32 LoRA state.

    With a `mesh`, the model's shape is checked against it first (ValueError naming the value that does not divide),
    every tensor goes straight to its sharding as it is read, and the hidden states between layers are pinned to
    the fsdp batch layout; `LoadedModel.placement` then holds the shardings. `scan_layers`: stacked, scanned
    layers (decoder.DecoderStack, where the family stacks them) instead of a per-layer list.
    `compute_dtype_residual`: the residual stream between layers in `dtype` (decoder.CausalLM says what it costs).
    """
    path = Path(model_dir)
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    placement = DeviceLayout(mesh, config) if mesh is not None else None
    names = family_named(config.arch).checkpoint_names(config)
    abstract = _abstract_model(
        config,
        placement,
        max_adapters=max_adapters,
        max_rank=max_rank,
        dtype=dtype,
        remat=remat,
        scan_layers=scan_layers,
        compute_dtype_residual=compute_dtype_residual,
    )
    graphdef, lora, base = nnx.split(abstract, nnx.LoRAParam, nnx.Param)
    pure = nnx.to_pure_dict(base)
    missing = {p for p, _ in _flat_paths(pure)}
    stacks = _LayerStacks(pure, config.num_layers) if abstract.scan_layers else None

    def place(state_path: tuple, tensor: Any) -> None:
        if placement is not None:
            tensor = jax.device_put(tensor, placement.sharding_of(state_path, tensor.shape))
        _set(pure, state_path, tensor)
        missing.discard(state_path)

    files = _shard_files(path)
    total = 0
    for f in files:
        with safe_open(f, framework="flax") as st:
            total += len(st.keys())
    bar = _progress(total, f"loading {path.name}", enabled=progress)
    skipped = []
    for f in files:
        with safe_open(f, framework="flax") as st:
            for name in st.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                bar.update(1)
                if names.gather(name, partial(st.get_tensor, name)):
                    continue
                target = names.state_path(name)
                if target is None:
                    skipped.append(name)
                    continue
                state_path, transpose = target
                layer = None
                if stacks is not None and state_path[0] == "layers":
                    layer, state_path = int(state_path[1]), ("layers", *state_path[2:])
                tensor = st.get_tensor(name)
                expected = _get(pure, state_path)
                if layer is not None:
                    expected = jax.ShapeDtypeStruct(expected.shape[1:], expected.dtype)
                if tuple(expected.shape[::-1] if transpose else expected.shape) != tuple(tensor.shape):
                    shape = tuple(tensor.shape[::-1]) if transpose else tuple(tensor.shape)
                    raise ValueError(f"{name}: checkpoint shape {shape} != model shape {expected.shape}")
                # Matrices in the model's dtype, norms (1-D) float32, as the abstract model declares them.
                tensor = tensor.astype(expected.dtype)
                if transpose:
                    tensor = tensor.T
                if layer is None:
                    place(state_path, tensor)
                else:
                    assert stacks is not None  # a layer index is split off only for stacked layers
                    full = stacks.put(state_path, layer, tensor, name)
                    if full is not None:  # the leaf's last layer: the stack goes to the device in one piece
                        place(state_path, full)
    bar.close()
    for state_path, tensor in names.gathered():
        expected = _get(pure, state_path)
        if tuple(tensor.shape) != tuple(expected.shape):
            where = ".".join(map(str, state_path))
            raise ValueError(f"{where}: checkpoint shape {tuple(tensor.shape)} != model shape {expected.shape}")
        place(state_path, jnp.asarray(tensor, expected.dtype))
    if skipped:
        log.info("ignored %d checkpoint tensors (e.g. %s)", len(skipped), skipped[0])
    if stacks is not None:
        stacks.check_complete(path)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(map(str, missing))[:3]}")
    nnx.replace_by_pure_dict(base, pure)
    if placement is None:
        lora = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), lora)
    else:
        shardings = placement.param_shardings(lora)
        lora = jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), lora, shardings)
    return LoadedModel(config=config, hf_config=hf_config, graphdef=graphdef, lora=lora, base=base, placement=placement)


def random_model(
    hf_config: dict[str, Any],
    *,
    max_adapters: int,
    max_rank: int,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    seed: int = 0,
    std: float = 0.02,
    scan_layers: bool = True,
    remat: bool = False,
    compute_dtype_residual: bool = False,
) -> LoadedModel:
    """A model of `hf_config`'s shape with random weights drawn on the device, each leaf straight into its sharding
    (normal(0, std) matrices in `dtype`, norm weights 1): the shape of a real checkpoint without reading one, for
    benchmarks and device checks (writing a 16 GB Qwen3-8B checkpoint first would cost minutes)."""
    config = ModelConfig.from_hf(hf_config)
    placement = DeviceLayout(mesh, config) if mesh is not None else None
    abstract = _abstract_model(
        config,
        placement,
        max_adapters=max_adapters,
        max_rank=max_rank,
        dtype=dtype,
        remat=remat,
        scan_layers=scan_layers,
        compute_dtype_residual=compute_dtype_residual,
    )
    graphdef, lora, base = nnx.split(abstract, nnx.LoRAParam, nnx.Param)
    pure = nnx.to_pure_dict(base)
    key = jax.random.key(seed)
    for i, (path, leaf) in enumerate(_flat_paths(pure)):
        sharding = placement.sharding_of(path, leaf.shape) if placement is not None else None
        norm = "norm" in str(path[-2]) or path[-2] in ("input_layernorm", "post_attention_layernorm")

        def draw(k, shape=leaf.shape, dt=leaf.dtype, norm=norm):
            return jnp.ones(shape, dt) if norm else (jax.random.normal(k, shape, jnp.float32) * std).astype(dt)

        _set(pure, path, jax.jit(draw, out_shardings=sharding)(jax.random.fold_in(key, i)))
    nnx.replace_by_pure_dict(base, pure)
    if placement is None:
        lora = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), lora)
    else:
        shardings = placement.param_shardings(lora)
        lora = jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), lora, shardings)
    return LoadedModel(config=config, hf_config=hf_config, graphdef=graphdef, lora=lora, base=base, placement=placement)


def _abstract_model(
    config: ModelConfig,
    placement: DeviceLayout | None,
    *,
    max_adapters: int,
    max_rank: int,
    dtype: Any,
    remat: bool,
    scan_layers: bool,
    compute_dtype_residual: bool = False,
) -> CausalLM:
    """The model's shapes without its arrays (nnx.eval_shape), hidden states pinned to the fsdp batch layout on a
    mesh of more than one device: what both a checkpoint and random weights fill."""
    act_sharding = placement.batch_sharding(3) if placement is not None and placement.mesh.size > 1 else None
    return nnx.eval_shape(
        lambda: build_causal_lm(
            config,
            max_adapters=max_adapters,
            max_rank=max_rank,
            rngs=nnx.Rngs(0),
            param_dtype=dtype,
            remat=remat,
            act_sharding=act_sharding,
            scan_layers=scan_layers,
            compute_dtype_residual=compute_dtype_residual,
        )
    )


class _LayerStacks:
    """Host arrays [L, ...] of the stacked layers' base leaves, filled one layer at a time."""

    def __init__(self, pure: dict, num_layers: int):
        self.pure = pure
        self.num_layers = num_layers
        self.stacks: dict[tuple, np.ndarray] = {}
        self.seen: dict[tuple, set[int]] = {}

    def put(self, path: tuple, layer: int, tensor: Any, name: str) -> np.ndarray | None:
        """Write layer `layer` of leaf `path`; the full stack once every layer is in, else None."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"{name}: layer {layer} out of range (num_hidden_layers={self.num_layers})")
        if path not in self.stacks:
            abstract = _get(self.pure, path)
            self.stacks[path] = np.zeros(abstract.shape, abstract.dtype)  # ml_dtypes for bfloat16
            self.seen[path] = set()
        self.stacks[path][layer] = np.asarray(tensor)
        self.seen[path].add(layer)
        if len(self.seen[path]) < self.num_layers:
            return None
        self.seen.pop(path)
        return self.stacks.pop(path)

    def check_complete(self, checkpoint: Path) -> None:
        for path, seen in self.seen.items():
            absent = sorted(set(range(self.num_layers)) - seen)
            raise ValueError(f"checkpoint {checkpoint} lacks {'.'.join(map(str, path))} of layers {absent[:5]}")


def _flat_paths(tree: dict, prefix: tuple = ()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat_paths(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _progress(total: int, desc: str, *, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)


def eos_token_ids(model_dir: str, hf_config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer, in that order, without repeats."""
    found: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if int(v) not in found:
                found.append(int(v))

    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(hf_config.get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(found)
