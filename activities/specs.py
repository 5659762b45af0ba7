"""The one place the protocol's specs (workflows/protocol/work.py) become the engine's configs: explicit, field by
field, so a field added on either side is a choice made here rather than a silent `**dict`."""

from __future__ import annotations

from tinkerflow.workers.engine.types import OPTIMIZERS, AdamConfig, DimuonConfig, InputError, LoraConfig
from tinkerflow.workflows.protocol.work import AdamSpec, LoraSpec


def lora_config(spec: LoraSpec) -> LoraConfig:
    return LoraConfig(
        rank=int(spec.rank),
        seed=spec.seed,
        train_attn=spec.train_attn,
        train_mlp=spec.train_mlp,
        train_unembed=spec.train_unembed,
        optimizer=_optimizer(spec.optimizer),
    )


def _optimizer(name: str):
    if name not in OPTIMIZERS:
        raise InputError(f"optimizer {name!r} is not one this JAX worker runs ({', '.join(OPTIMIZERS)})")
    return name


def optim_config(spec: AdamSpec) -> AdamConfig | DimuonConfig:
    if _optimizer(spec.optimizer) == "dimuon":
        return DimuonConfig(
            learning_rate=float(spec.learning_rate),
            grad_clip_norm=float(spec.grad_clip_norm),
            beta1=float(spec.beta1),
            damping=float(spec.damping),
            rank_lr_correction_exponent=float(spec.rank_lr_correction_exponent),
        )
    return AdamConfig(
        learning_rate=float(spec.learning_rate),
        beta1=float(spec.beta1),
        beta2=float(spec.beta2),
        eps=float(spec.eps),
        weight_decay=float(spec.weight_decay),
        grad_clip_norm=float(spec.grad_clip_norm),
    )
