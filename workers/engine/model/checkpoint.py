"""Checkpoint formats, on local directories (the storage layer uploads and downloads them).

* Training state (`write_training_state` / `read_training_state`): a slot's LoRA weights, optimizer moments and step
  as one orbax checkpoint under `<dir>/state`, next to the same `adapter_config.json` a PEFT export has (rank,
  trained module groups), so the directory says what it holds without opening the arrays.
* PEFT (`write_peft` / `read_peft`): `adapter_model.safetensors` + `adapter_config.json` as PEFT's
  `save_pretrained` writes them for a LoRA on a Hugging Face `AutoModelForCausalLM` (Qwen3, Llama), loadable by
  `peft.PeftModel.from_pretrained` and vLLM. PEFT's A is our A transposed ([r, in]), its B our B transposed
  ([out, r]); scaling lora_alpha / r equals ours with lora_alpha = LORA_ALPHA.
  The unembedding LoRA is named as Tinker's own exports name it, `base_model.model.model.unembed_tokens.lora_{A,B}`
  (target module `unembed_tokens`), because that is the name tinker-cookbook's `weights.build_hf_model` and
  `build_lora_adapter` map: to `lm_head` when the model has one, else (tied embeddings) to `model.embed_tokens`,
  the shared matrix, which is what the engine computes on a tied model too (lora.lora_embedding_delta). PEFT's own
  `lm_head` name is still read. PEFT/vLLM take such an adapter through `build_lora_adapter`, as Tinker's.

Weights are named as `Engine.adapter_weights` names them ("layers.0.self_attn.q_proj.lora_a", "lm_head.lora_b").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..types import OPTIMIZERS, InputError, LoraConfig, SlotState
from .families import ModuleKind, lora_targets
from .lora import LORA_ALPHA, UNEMBED_STATE, module_kind

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
STATE_DIR = "state"
STATE_FORMAT = "tinkerflow.slot_state.v1"

_UNEMBED_EXPORT = "model.unembed_tokens"
_PEFT_PREFIX = "base_model.model."
# Ours: layers.3.self_attn.q_proj.lora_a / lm_head.lora_b (Qwen3.5 adds layers.0.linear_attn.in_proj_qkv and the
# shared expert's layers.0.mlp.shared_expert.up_proj). PEFT: base_model.model.model.layers.3.self_attn.q_proj.
# lora_A.weight / base_model.model.model.unembed_tokens.lora_B.weight (Tinker's; PEFT's base_model.model.lm_head.*
# is read as the same adapter).
_PEFT_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(layers\.\d+\.(?:self_attn|linear_attn|mlp)(?:\.shared_expert)?\.\w+)"
    r"|(lm_head|model\.unembed_tokens))"
    r"\.lora_([AB])\.weight$"
)
# Routed experts as hosted Tinker exports them, which tinker-cookbook's weights tools (build_hf_model,
# build_lora_adapter) read: one tensor per projection for every expert, A [E, r, in] and B [E, out, r], under
# Tinker's names w1 (gate), w3 (up), w2 (down): base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight.
# Ours stack them the same way, [E, in, r] / [E, r, out], as layers.0.mlp.experts.gate_proj.
_EXPERT_EXPORT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_TINKER_EXPERT_KEY = re.compile(
    r"^base_model\.model\.model\.(layers\.\d+\.mlp\.experts)\.(w1|w2|w3)\.lora_([AB])\.weight$"
)
# The same experts one tensor each, as PEFT names them on per-expert linears (build_lora_adapter's output for vLLM,
# and tinkerflow's exports before it wrote Tinker's layout): layers.0.mlp.experts.5.up_proj.lora_A.weight.
_PEFT_EXPERT_KEY = re.compile(
    r"^base_model\.model\.model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)
# Settings PEFT writes that must keep these values for the adapter to mean what our LoRA means.
_PEFT_REQUIRED = {
    "fan_in_fan_out": False,
    "use_dora": False,
    "lora_bias": False,
    "bias": "none",
}
_PEFT_EMPTY = (
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "layers_to_transform",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "exclude_modules",
)


# ---------------------------------------------------------------------------------------------------- configs


def _groups() -> dict[str, ModuleKind]:
    """The LoRA target modules adapter files may name (the families', plus PEFT's own `lm_head` for the
    unembedding, read too), by train group."""
    return {**lora_targets(), "lm_head": "unembed"}


def _target_modules(config: LoraConfig, weights: dict[str, Any]) -> list[str]:
    """The export names of the modules `weights` holds LoRA of, in a trained group, in the families' order."""
    held = {name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for name in weights}
    held = {"unembed_tokens" if m == UNEMBED_STATE else m for m in held}
    return [m for m, group in lora_targets().items() if m in held and _trained(config)[group]]


def lora_config_to_peft(config: LoraConfig, targets: list[str], *, base_model_name_or_path: str) -> dict[str, Any]:
    """adapter_config.json for `config`: PEFT's LoraConfig fields that matter, target_modules = `targets`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": int(LORA_ALPHA) if float(LORA_ALPHA).is_integer() else LORA_ALPHA,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def lora_config_from_peft(config: dict[str, Any]) -> LoraConfig:
    """The LoraConfig of a PEFT adapter_config.json; InputError naming what we cannot represent. A group (attn, mlp,
    unembed) is trained when any of its modules is targeted (the others then hold zeros); any lora_alpha > 0 is
    accepted (see `peft_scaling`)."""
    if not isinstance(config, dict):
        raise InputError(f"{ADAPTER_CONFIG} must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise InputError(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} is not supported (only 'LORA')")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"{ADAPTER_CONFIG}: r must be a positive integer, got {rank!r}")
    peft_scaling(config)  # validates lora_alpha and use_rslora
    for key, value in _PEFT_REQUIRED.items():
        if config.get(key, value) != value:
            raise InputError(f"{ADAPTER_CONFIG}: {key}={config[key]!r} is not supported (only {value!r})")
    for key in _PEFT_EMPTY:
        if config.get(key):
            raise InputError(f"{ADAPTER_CONFIG}: {key}={config[key]!r} is not supported (must be empty)")
    targets = config.get("target_modules")
    known = _groups()
    if targets == "all-linear":  # PEFT: every linear layer but the output layer
        targets = [m for m, group in known.items() if group != "unembed"]
    if not isinstance(targets, list):
        raise InputError(f"{ADAPTER_CONFIG}: target_modules must be a list of module names, got {targets!r}")
    unknown = sorted({str(t) for t in targets} - set(known))
    if unknown:
        raise InputError(f"{ADAPTER_CONFIG}: target_modules {unknown} are not supported (only {sorted(known)})")
    groups = {known[t] for t in targets}
    return LoraConfig(
        rank=rank, train_attn="attn" in groups, train_mlp="mlp" in groups, train_unembed="unembed" in groups
    )


def peft_scaling(config: dict[str, Any]) -> float:
    """PEFT's LoRA scaling for an adapter_config.json: lora_alpha / r (or / sqrt(r) with use_rslora)."""
    alpha, rank = config.get("lora_alpha", 8), config["r"]  # r: checked by lora_config_from_peft
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise InputError(f"{ADAPTER_CONFIG}: lora_alpha must be a positive number, got {alpha!r}")
    if config.get("use_rslora", False) not in (True, False):
        raise InputError(f"{ADAPTER_CONFIG}: use_rslora must be a boolean, got {config['use_rslora']!r}")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _trained(config: LoraConfig) -> dict[str, bool]:
    return {"attn": config.train_attn, "mlp": config.train_mlp, "unembed": config.train_unembed}


def _group(name: str) -> str:
    return module_kind(tuple(name.split(".")))


def _read_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / ADAPTER_CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path.name} is missing from the checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{ADAPTER_CONFIG} is not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------------- PEFT


def write_peft(
    config: LoraConfig, weights: dict[str, np.ndarray], directory: Path, *, base_model_name_or_path: str
) -> None:
    """adapter_model.safetensors (float32) + adapter_config.json in `directory`; only trained groups' modules."""
    from safetensors.numpy import save_file

    trained = _trained(config)
    if not any(trained.values()):
        raise InputError("a LoRA that trains no module group (attn, mlp, unembed) has nothing to export")
    tensors = {}
    for name, value in weights.items():
        if not trained[_group(name)]:
            continue
        module, ab = name.rsplit(".lora_", 1)
        value = np.asarray(value, np.float32)
        if ".experts." in module:  # stacked [E, in, r] / [E, r, out]: Tinker's [E, r, in] / [E, out, r]
            parent, proj = module.rsplit(".", 1)
            key = f"{_PEFT_PREFIX}model.{parent}.{_EXPERT_EXPORT_NAMES[proj]}.lora_{ab.upper()}.weight"
            tensors[key] = np.ascontiguousarray(np.swapaxes(value, -1, -2))
            continue
        key = (
            _PEFT_PREFIX
            + (_UNEMBED_EXPORT if module == "lm_head" else "model." + module)
            + f".lora_{ab.upper()}.weight"
        )
        tensors[key] = np.ascontiguousarray(value.T)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    targets = _target_modules(config, weights)
    peft_config = lora_config_to_peft(config, targets, base_model_name_or_path=base_model_name_or_path)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")


def read_peft(directory: Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(config, weights named as adapter_weights, float32) of a PEFT LoRA directory. A lora_alpha other than ours is
    folded into B (exact up to float32 rounding); PEFT's copies of frozen base layers ("base_layer") are skipped."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = Path(directory)
    raw = _read_config(directory)
    config = lora_config_from_peft(raw)
    factor = peft_scaling(raw) / (LORA_ALPHA / config.rank)
    path = directory / ADAPTER_WEIGHTS
    if not path.exists():
        raise InputError(f"{ADAPTER_WEIGHTS} is missing from the adapter")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{ADAPTER_WEIGHTS} cannot be read: {e}") from None

    targets = {m for m, group in lora_targets().items() if _trained(config)[group]}
    groups = {group for group, on in _trained(config).items() if on}  # unembedding: either name, either target
    weights: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for key, value in tensors.items():
        if key.endswith(".base_layer.weight"):
            continue
        stacked = _TINKER_EXPERT_KEY.match(key)
        if stacked is not None:
            parent, tinker_name, ab = stacked.groups()
            proj = {w: p for p, w in _EXPERT_EXPORT_NAMES.items()}[tinker_name]
            if proj not in targets:
                raise InputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} is not in target_modules {sorted(targets)}")
            if value.ndim != 3 or value.shape[1 if ab == "A" else 2] != config.rank:
                raise InputError(
                    f"{ADAPTER_WEIGHTS}: tensor {key!r} has shape {value.shape}, "
                    f"not [experts, ...] of rank r={config.rank}"
                )
            ours = np.ascontiguousarray(np.swapaxes(value.astype(np.float32), -1, -2))
            ours = ours * np.float32(factor) if ab == "B" and factor != 1 else ours
            name = f"{parent}.{proj}.lora_{ab.lower()}"
            if name in weights or name in experts:
                raise InputError(f"{ADAPTER_WEIGHTS}: {name} is there twice (stacked and per expert)")
            weights[name] = ours
            continue
        expert = _PEFT_EXPERT_KEY.match(key)
        if expert is not None:
            parent, index, proj, ab = expert.groups()
            if proj not in targets:
                raise InputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} is not in target_modules {sorted(targets)}")
            if value.ndim != 2 or value.shape[0 if ab == "A" else 1] != config.rank:
                raise InputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} has shape {value.shape}, not rank r={config.rank}")
            ours = np.ascontiguousarray(value.astype(np.float32).T)
            ours = ours * np.float32(factor) if ab == "B" and factor != 1 else ours
            experts.setdefault(f"{parent}.{proj}.lora_{ab.lower()}", {})[int(index)] = ours
            continue
        match = _PEFT_KEY.match(key)
        if match is None:
            raise InputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} is not a LoRA A/B of a supported module")
        module, ab = match.group(1) or "lm_head", match.group(3)  # group 2: either unembedding name
        name = module.rsplit(".", 1)[-1]
        if name not in targets and not (name == "lm_head" and "unembed" in groups):
            raise InputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} is not in target_modules {sorted(targets)}")
        if value.ndim != 2 or value.shape[0 if ab == "A" else 1] != config.rank:
            raise InputError(f"{ADAPTER_WEIGHTS}: tensor {key!r} has shape {value.shape}, not rank r={config.rank}")
        if f"{module}.lora_{ab.lower()}" in weights:
            raise InputError(f"{ADAPTER_WEIGHTS}: the unembedding LoRA is there twice (lm_head and unembed_tokens)")
        ours = np.ascontiguousarray(value.astype(np.float32).T)
        weights[f"{module}.lora_{ab.lower()}"] = ours * np.float32(factor) if ab == "B" and factor != 1 else ours
    for name, by_expert in experts.items():
        if name in weights:
            raise InputError(f"{ADAPTER_WEIGHTS}: {name} is there twice (stacked and per expert)")
        if sorted(by_expert) != list(range(len(by_expert))):
            absent = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
            raise InputError(f"{ADAPTER_WEIGHTS}: {name} lacks experts {absent[:5]}")
        shapes = {v.shape for v in by_expert.values()}
        if len(shapes) != 1:
            raise InputError(f"{ADAPTER_WEIGHTS}: {name} has experts of different shapes {sorted(shapes)}")
        weights[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    if not weights:
        raise InputError(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    halves = {n.rsplit(".lora_", 1)[0] for n in weights}
    unpaired = sorted(m for m in halves if f"{m}.lora_a" not in weights or f"{m}.lora_b" not in weights)
    if unpaired:
        raise InputError(f"{ADAPTER_WEIGHTS}: {unpaired[:3]} have lora_A without lora_B or the reverse")
    return config, weights


# ---------------------------------------------------------------------------------------------------- training state


def write_training_state(state: SlotState, directory: Path, *, base_model_name_or_path: str = "") -> None:
    """`directory`/state (orbax: weights, mu, nu, step; the optimizer family in its metadata) +
    `directory`/adapter_config.json; blocks until written."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    tree = {
        "weights": _float32(state.weights),
        "mu": _float32(state.mu),
        "nu": _float32(state.nu),
        "step": np.asarray(state.step, np.int64),
    }
    meta = {"format": STATE_FORMAT, "seed": state.config.seed, "optimizer": state.config.optimizer}
    with _checkpointer() as checkpointer:
        checkpointer.save(directory / STATE_DIR, tree, force=True, custom_metadata=meta)
        checkpointer.wait_until_finished()
    targets = _target_modules(state.config, state.weights)
    peft_config = lora_config_to_peft(state.config, targets, base_model_name_or_path=base_model_name_or_path)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")


def read_training_state(directory: Path) -> SlotState:
    """The SlotState written by write_training_state (InputError when `directory` does not hold one)."""
    directory = Path(directory).resolve()
    raw = _read_config(directory)
    config = lora_config_from_peft(raw)
    if peft_scaling(raw) != LORA_ALPHA / config.rank:
        raise InputError(
            f"training state with lora_alpha={raw.get('lora_alpha')!r} (use_rslora={raw.get('use_rslora', False)}); "
            f"only {LORA_ALPHA} without rsLoRA can resume training"
        )
    if not (directory / STATE_DIR).is_dir():
        raise InputError(f"{STATE_DIR}/ is missing: not a training checkpoint (a PEFT export has no optimizer state)")
    try:
        with _checkpointer() as checkpointer:
            meta = checkpointer.metadata(directory / STATE_DIR).custom_metadata or {}
            if meta.get("format") != STATE_FORMAT:
                raise InputError(f"{STATE_DIR}/ has format {meta.get('format')!r}, expected {STATE_FORMAT!r}")
            tree = checkpointer.restore(directory / STATE_DIR)
        weights, mu, nu, step = (tree[k] for k in ("weights", "mu", "nu", "step"))
    except (KeyError, FileNotFoundError, ValueError) as e:  # InputError is a ValueError: kept as it is
        raise e if isinstance(e, InputError) else InputError(f"{STATE_DIR}/ cannot be read: {e!r}") from None
    family = meta.get("optimizer", "adamw")  # states written before Dimuon are AdamW's
    if family not in OPTIMIZERS:
        raise InputError(f"{STATE_DIR}/ holds state of optimizer {family!r}; this server knows {list(OPTIMIZERS)}")
    return SlotState(
        config=replace(config, seed=meta.get("seed"), optimizer=family),
        weights=_float32(weights),
        mu=_float32(mu),
        nu=_float32(nu),
        step=int(step),
    )


def _checkpointer() -> Any:
    """An orbax checkpointer local to this process: the state is host numpy and the directory local, so under
    jax.distributed (multi-host) the caller's process alone writes, with no barrier waiting for the others."""
    import jax
    import orbax.checkpoint as ocp

    me = jax.process_index()
    return ocp.StandardCheckpointer(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    )


def _float32(named: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float32) for k, v in named.items()}
