"""Model families: each architecture the engine serves is one folder here, behind one small interface.

`ModelConfig` is what every family reads its `config.json` into (the shapes the shared building blocks of `model/`
read); `Family` is what a family answers to the trainer, sampler, loader, exporter, memory plan and accelerator
metrics; the registry finds the family of a `config.json` by its `model_type`.

A family folder `families/<name>/` holds:

* `__init__.py`: its docstring and `MODEL_TYPES`, the config.json `model_type`s it reads. It imports nothing, so a
  process that only needs to know whether a checkpoint is served (`tinkerflow up`, which then starts the JAX worker)
  asks `family_name_of` without loading JAX;
* `family.py`: `FAMILY`, its `Family`: layers for model/'s decoder, or a whole causal LM of its own
  (`Family.causal_lm`, built by decoder.build_causal_lm);
* the modules of what is its own (Qwen3-MoE: its config fields, its checkpoint's per-expert tensors, its tiny
  checkpoint). What families share stays in `model/`: the attention kernels, the dense decoder layer, the routed
  expert block, LoRA, RMSNorm and rope, the generic loader and exporter, the tiny checkpoint's tokenizer and writer.

The registry looks the folders up itself (a folder without `MODEL_TYPES` is not a family yet), so adding a family is
adding a folder, its package line in pyproject.toml (tests/platform/test_packaging.py names it) and its parity test
against transformers; nothing outside the folder names it.
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from flax import nnx

# The family of the embedded default model (the tiny checkpoint `tinkerflow up` serves without --base-model).
EMBEDDED_DEFAULT = "qwen3"

# What the sampler keeps for one layer between decode steps: keys and values of every position ("kv"), or a
# fixed-size recurrent state ("recurrent", linear-attention layers: the family's cache.py builds it, slot_cache.py).
CacheKind = Literal["kv", "recurrent"]
# The train_attn / train_mlp / train_unembed group of a LoRA target module.
ModuleKind = Literal["attn", "mlp", "unembed"]
StatePath = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # the family's name (its folder)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm of q and k in attention (the family's choice)
    # Llama 3 style rope scaling ("llama3"), or None for plain rope.
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    # The routed-expert block's settings (model/moe.py); num_experts == 0 for dense models. `moe_layers` lists the
    # decoder layers whose MLP is that block, as the family's config reader resolves them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be divisible by num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json by its family; ValueError for anything this engine cannot run exactly."""
        return family_of(hf).read_config(hf)

    @classmethod
    def read(cls, hf: dict[str, Any], *, arch: str, qk_norm: bool, **family_fields: Any) -> ModelConfig:
        """The fields every decoder family reads alike, from a parsed config.json, with the refusals they share;
        `family_fields`: the family's own (e.g. the routed experts' settings)."""
        model_type = hf.get("model_type")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError(f"{model_type} with attention_bias/mlp_bias is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        if hf.get("quantization_config"):  # e.g. Qwen3-30B-A3B-FP8: weights need their scales, which we do not apply
            method = (hf["quantization_config"] or {}).get("quant_method", "?")
            raise ValueError(f"quantized checkpoints ({method}) are not supported; use the bf16/fp32 release")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        num_heads = hf["num_attention_heads"]
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            **_rope_fields(hf),
            **family_fields,
        )

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def inv_freq(self) -> np.ndarray:
        """Rope inverse frequencies [head_dim // 2], with llama3 scaling applied as transformers does."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_scaling is None:
            return inv.astype(np.float32)
        s = dict(self.rope_scaling)
        factor, low, high, old_ctx = (
            s["factor"],
            s["low_freq_factor"],
            s["high_freq_factor"],
            s["original_max_position_embeddings"],
        )
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling; transformers 5 moved them under rope_parameters, older files keep them on top."""
    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else (hf.get("rope_scaling") or None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            rope_scaling = tuple((k, float(scaling[k])) for k in keys)
        elif kind != "default":
            raise ValueError(f"rope scaling type {kind!r} is not supported (only llama3)")
    return {"rope_theta": float(rope_theta), "rope_scaling": rope_scaling}


@dataclass(frozen=True)
class LayerOptions:
    """How the engine builds every layer: LoRA slots and rank, the base weights' dtype, the rngs."""

    max_adapters: int
    max_rank: int
    rngs: nnx.Rngs
    param_dtype: Any

    def kwargs(self) -> dict[str, Any]:
        """As the layers of model/ take them (keywords)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CheckpointNames(Protocol):
    """A family's checkpoint tensor names against the model's NNX state paths, asked tensor by tensor at load."""

    def state_path(self, name: str) -> tuple[StatePath, bool] | None:
        """(state path, transpose?) of a tensor that fills one state leaf (of one layer); None: not such a tensor."""
        ...

    def gather(self, name: str, read: Callable[[], np.ndarray]) -> bool:
        """Keep a tensor that is one piece of a stacked leaf (`read()` gives it); False: not such a tensor."""
        ...

    def gathered(self) -> Iterator[tuple[StatePath, np.ndarray]]:
        """The stacked leaves once every tensor was offered; ValueError naming a piece the checkpoint lacks."""
        ...


class StateCache(Protocol):
    """What a family whose layers keep a recurrent state gives the sampler for its decode slots (model/slot_cache.py):
    its cache answers what the sampler asks of any cache (`k`/`v`, `through(rows, lengths, fresh)`, `settled()`)."""

    # `config`: the family's own ModelConfig (its read_config's), hence Any here; positional, as slot_cache calls.
    def empty_cache(self, config: Any, slots: int, length: int, dtype: Any, /) -> Any: ...

    def state_bytes_per_slot(self, config: Any, /) -> int: ...

    # The prefix cache's pool with `states` state snapshots beside its blocks (sampling/prefix_cache.py).
    def empty_pool(self, config: Any, blocks: int, block: int, states: int, dtype: Any, /) -> Any: ...


@dataclass(frozen=True)
class TinyCheckpoint:
    """A family's tiny offline checkpoint (model/tiny_model.py writes it with the shared tokenizer)."""

    config: Callable[[int], dict[str, Any]]  # eos token id -> config.json as transformers writes it
    parameter_shapes: Callable[[], list[tuple[str, tuple[int, ...]]]]  # HF names and shapes, in draw order
    marker: Mapping[str, Any] = field(default_factory=dict)  # what tells its directory from another family's
    # A norm weight's value by tensor name (1.0 for every norm by default; a zero-centred norm, scaling by 1 + w, is
    # 0.0 at its identity, as transformers initialises it).
    norm_weight: Callable[[str], float] = lambda name: 1.0
    # Special tokens after the shared tokenizer's (its chat format's: thinking, tool calls, vision placeholders) and
    # the chat template over them; none and None: the shared ChatML tokenizer as it is.
    extra_tokens: tuple[str, ...] = ()
    chat_template: str | None = None
    # JSON files written beside config.json, by name (a vision-language checkpoint's preprocessor_config.json).
    extra_json: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """What one family answers. Callables take the family's `ModelConfig` (as its `read_config` made it)."""

    name: str  # its folder, and ModelConfig.arch
    read_config: Callable[[dict[str, Any]], ModelConfig]  # config.json -> ModelConfig (ValueError: cannot run)
    decoder_layer: Callable[[ModelConfig, int, LayerOptions], nnx.Module]  # layer i, attention + MLP kinds chosen
    # Every layer stacked into one for the scan (decoder.DecoderStack), or None where layers differ.
    decoder_stack: Callable[[ModelConfig, LayerOptions], nnx.Module] | None
    checkpoint_names: Callable[[ModelConfig], CheckpointNames]
    # LoRA target modules as PEFT and Tinker exports name them, by train group.
    lora_targets: Mapping[str, ModuleKind]
    cache_kinds: Callable[[ModelConfig], tuple[CacheKind, ...]]  # what the sampler keeps, per layer
    matmul_params: Callable[[ModelConfig], int]  # weights one token's forward multiplies through (MFU)
    # One layer's forward intermediates per token, in bytes (the widest layer): (config, compute dtype bytes,
    # max LoRA rank) -> bytes, for the memory plan.
    activation_bytes: Callable[[ModelConfig, int, int], int]
    tiny: TinyCheckpoint | None = None
    tiny_vision: TinyCheckpoint | None = None  # its vision-language twin (make-tiny-model --vision), if it has one
    # The family's own causal LM, for a family whose model is not decoder.CausalLM over its layers (other norms,
    # rope or layer kinds): called as decoder.CausalLM is (config, max_adapters=, max_rank=, rngs=, param_dtype=,
    # remat=, act_sharding=, scan_layers=), with its `hidden`, `logits`, `dtype`, `lm_head` and `scan_layers`.
    # `decoder_layer` / `decoder_stack` are then unused. None: decoder.CausalLM.
    causal_lm: Callable[..., nnx.Module] | None = None
    # The sampler's slot cache of a family with "recurrent" layers (e.g. the family's cache.py module); None: every
    # layer caches keys and values in kv_cache.LayerCache.
    state_cache: StateCache | None = None
    # A vision-language family's training images: (config, laid-out tokens [B, T], segments [B, T], the images in
    # placeholder order) -> what its causal LM's `hidden(..., images=)` takes. None: the family takes no images.
    image_batch: Callable[[ModelConfig, np.ndarray, np.ndarray, Sequence[Any]], Any] | None = None


@functools.cache
def _folders() -> dict[str, str]:
    """model_type -> the family folder that reads it."""
    served: dict[str, str] = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg:
            continue
        for model_type in getattr(importlib.import_module(f"{__name__}.{info.name}"), "MODEL_TYPES", ()):
            if model_type in served:
                raise RuntimeError(
                    f"model_type {model_type!r} is read by two families: {served[model_type]}, {info.name}"
                )
            served[model_type] = info.name
    return served


def served_names() -> list[str]:
    """Every family's name, sorted."""
    return sorted(set(_folders().values()))


def served() -> list[str]:
    """Every family, as `name (model_type ...)`, sorted: what an unsupported architecture's error lists."""
    types = {name: sorted(t for t, n in _folders().items() if n == name) for name in served_names()}
    return [f"{name} (model_type {', '.join(types[name])})" for name in served_names()]


def family_name_of(hf: dict[str, Any]) -> str:
    """The family that reads this config.json (without loading it); ValueError in one line naming the architecture
    and the families served."""
    model_type = hf.get("model_type")
    name = _folders().get(model_type) if isinstance(model_type, str) else None
    if name is None:
        archs = ", ".join(map(str, hf.get("architectures") or [])) or "no architectures listed"
        raise ValueError(f"unsupported architecture {model_type!r} ({archs}); families served: {', '.join(served())}")
    return name


def family_of(hf: dict[str, Any]) -> Family:
    return family_named(family_name_of(hf))


@functools.cache
def family_named(name: str) -> Family:
    """The family whose folder is `name` (ModelConfig.arch)."""
    if name not in served_names():
        raise ValueError(f"no model family {name!r}; families served: {', '.join(served())}")
    family = importlib.import_module(f"{__name__}.{name}.family").FAMILY
    if not isinstance(family, Family) or family.name != name:
        raise RuntimeError(f"{__name__}.{name}.family.FAMILY must be the Family named {name!r}")
    return family


@functools.cache
def lora_targets() -> Mapping[str, ModuleKind]:
    """Every family's LoRA target modules by train group: the names adapter files and slots are read by."""
    targets: dict[str, ModuleKind] = {}
    for name in served_names():
        for module, kind in family_named(name).lora_targets.items():
            if targets.setdefault(module, kind) != kind:
                raise RuntimeError(f"LoRA target {module!r} is {targets[module]} in one family and {kind} in {name}")
    return targets
