"""The optimizer of a training run, as the SDK names it: its family at creation (`optimizer_config`: AdamW, the
default, or Dimuon) and the hyper-parameters of each optim_step (`AdamParams` or `DimuonParams`, which must match
the family; the JAX worker checks that, knowing the run's slot).

Every field the SDK may send is either honoured or refused by name: a key this server does not know is an error,
never dropped (docs/optimizers.md)."""

from __future__ import annotations

import math
from typing import Any

from tinker.types import AdamParams

from tinkerflow.api.op_checks import adam_problem
from tinkerflow.workflows.protocol.work import AdamSpec

FAMILIES = ("adamw", "dimuon")
# DimuonParams' fields: the SDK's own (learning_rate, grad_clip_norm, beta1) and the two the public reference also
# documents (damping, rank_lr_correction_exponent), which newer SDKs send; omitted ones take these defaults.
DIMUON_DEFAULTS = {"grad_clip_norm": 0.0, "beta1": 0.9, "damping": 1.0, "rank_lr_correction_exponent": 0.5}


def family(config: Any) -> tuple[str, str]:
    """(family, problem) of an `optimizer_config` (None: AdamW). The problem names what is wrong ("" when nothing)."""
    if config is None:
        return "adamw", ""
    raw = config.model_dump() if hasattr(config, "model_dump") else dict(config)
    kind = raw.pop("type", None)
    if kind not in FAMILIES:
        return "", (
            f"optimizer_config type {kind!r} is not supported; use AdamOptimizerConfig (type 'adamw') or "
            "DimuonOptimizerConfig (type 'dimuon')"
        )
    if kind == "dimuon" and raw.pop("version", 1) != 1:
        return "", "optimizer_config: DimuonOptimizerConfig version must be 1"
    if raw:
        return "", f"optimizer_config ({kind}) has unknown fields {sorted(raw)}"
    return kind, ""


def optim_spec(params: Any) -> tuple[AdamSpec | None, str]:
    """The AdamSpec of an optim_step's parameters (AdamParams, or DimuonParams as a generic OptimParamsBase), or None
    and the problem, naming the field."""
    if isinstance(params, AdamParams):
        problem = adam_problem(params)
        if problem:
            return None, problem
        return AdamSpec(
            learning_rate=params.learning_rate,
            beta1=params.beta1,
            beta2=params.beta2,
            eps=params.eps,
            weight_decay=params.weight_decay,
            grad_clip_norm=params.grad_clip_norm,
        ), ""
    raw = params.model_dump() if hasattr(params, "model_dump") else dict(params)
    kind = raw.pop("type", None)
    if kind != "dimuon":
        return None, f"optimizer_params type {kind!r} is not supported; use AdamParams or DimuonParams"
    unknown = sorted(set(raw) - {"learning_rate", *DIMUON_DEFAULTS})
    if unknown:
        return None, f"optimizer_params (dimuon) has unknown fields {unknown}"
    if "learning_rate" not in raw:
        return None, "optimizer_params.learning_rate is required for DimuonParams"
    values = {**DIMUON_DEFAULTS, **raw}
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None, f"optimizer_params.{name} must be a finite number, got {v!r}"
    if values["learning_rate"] < 0:
        return None, f"optimizer_params.learning_rate must be >= 0, got {values['learning_rate']}"
    if not 0 <= values["beta1"] < 1:
        return None, f"optimizer_params.beta1 must be in [0, 1), got {values['beta1']}"
    if not values["damping"] > 0:
        return None, f"optimizer_params.damping must be > 0, got {values['damping']}"
    return AdamSpec(
        learning_rate=float(values["learning_rate"]),
        beta1=float(values["beta1"]),
        grad_clip_norm=float(values["grad_clip_norm"]),
        optimizer="dimuon",
        damping=float(values["damping"]),
        rank_lr_correction_exponent=float(values["rank_lr_correction_exponent"]),
    ), ""


def config_of(name: str) -> dict[str, Any]:
    """The SDK's optimizer_config for a family (weights_info)."""
    return {"type": "dimuon", "version": 1} if name == "dimuon" else {"type": "adamw"}
