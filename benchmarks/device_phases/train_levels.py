"""The train phase's gradient-checkpointing levels (model/remat.py) and its utilisation figures: which level each
train line runs at (forced, or the memory plan's), and what its FLOPs over the peak are at that level."""

from __future__ import annotations

import os

from benchmarks.device_phases.flops import train_flops

CONVENTIONS = (
    "mfu_lora: 4N + 6P + 3 attention forwards; hfu: that + remat's 2(N - unembed) + 2P_layers + 1 attention forward "
    "(remat=full; at none or dots hfu = mfu_lora); "
    "flops_6n_over_peak: the 6N full fine-tuning convention, not an MFU of LoRA (benchmarks/device_phases/flops.py)"
)


# The train phase's gradient-checkpointing levels, comma-separated (device_check.py --remat sets it): none, dots, full
# (forced on every micro-batch: model/remat.py), or plan (what the memory plan picks by length). Each train line
# names its level (`remat`).
REMAT_ENV = "DEVICE_CHECK_REMAT"
REMAT_CHOICES = ("none", "dots", "full", "plan")
# "1": the engine keeps the residual stream between layers in the compute dtype (decoder.CausalLM's
# compute_dtype_residual; device_check.py --compute-dtype-residual). Each train line says which (`residual`).
RESIDUAL_ENV = "DEVICE_CHECK_COMPUTE_DTYPE_RESIDUAL"


def remat_levels() -> list[str]:
    """The levels the train phase runs, in order (default: full, as every run before the choice existed)."""
    levels = [x.strip() for x in os.environ.get(REMAT_ENV, "full").split(",") if x.strip()]
    unknown = sorted(set(levels) - set(REMAT_CHOICES))
    if unknown:
        raise ValueError(f"{REMAT_ENV}: unknown levels {unknown}; choose from {', '.join(REMAT_CHOICES)}")
    return levels or ["full"]


def compute_dtype_residual() -> bool:
    """Whether the engine keeps the residual stream between layers in the compute dtype (RESIDUAL_ENV)."""
    return os.environ.get(RESIDUAL_ENV) == "1"


def force_remat(engine, level: str, tokens_per_row: int) -> str:
    """Make every train step run at `level` (plan: the memory plan's thresholds by length); returns the level a
    row of `tokens_per_row` tokens in an 8-row micro-batch takes, as the train lines report it."""
    from tinkerflow.workers.engine.model.remat import Remat

    steps, plan = engine._steps, engine.memory
    if level == "plan":
        steps.forced_remat = None
        steps.remat_min_tokens, steps.full_remat_min_tokens = plan.remat_min_tokens, plan.full_remat_min_tokens
        return plan.remat_for(8 * tokens_per_row).value
    steps.forced_remat = Remat(level)
    return level


def utilisation(
    engine, cfg: dict, n_params: int, lengths: list[int], seconds: float, peak: float | None, remat: str = "full"
) -> dict:
    """mfu_lora, hfu and the full fine-tuning 6·N figure of one step over the datasheet peak (flops.py says
    what each counts; `remat`: the level the step ran at, which decides what hfu adds)."""
    weights = engine.adapter_weights(0)
    adapter = sum(w.size for w in weights.values())  # each A and B entry is one multiply-add per token
    unembed = sum(w.size for k, w in weights.items() if "lm_head" in k)
    f = train_flops(cfg, n_params, lengths, adapter, unembed, recomputes=remat == "full")

    def over_peak(flops: float) -> float | None:
        return round(flops / seconds / peak, 3) if peak else None

    return {
        "mfu_lora": over_peak(f["model"]),
        "hfu": over_peak(f["hardware"]),
        "flops_6n_over_peak": over_peak(f["flops_6n"]),
        "peak": "bf16 dense datasheet",
        "model_gflop": round(f["model"] / 1e9, 3),
        "hardware_gflop": round(f["hardware"] / 1e9, 3),
        "flops_conventions": CONVENTIONS,
    }
