"""Our adapter's weights in a PEFT model of the same checkpoint, for the vision-language parity tests."""

from __future__ import annotations

from typing import Any

import numpy as np


def copy_our_lora(model: Any, ours: dict[str, np.ndarray]) -> dict[str, Any]:
    """Set every PEFT LoRA module of `model` to our adapter's A and B (`Engine.adapter_weights`, by `layers.`
    path); returns the modules set, by that path."""
    import torch

    wrapped = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                path = "layers." + name.split(".layers.", 1)[1]
                module.lora_A["default"].weight.copy_(torch.from_numpy(ours[f"{path}.lora_a"].T.copy()))
                module.lora_B["default"].weight.copy_(torch.from_numpy(ours[f"{path}.lora_b"].T.copy()))
                wrapped[path] = module
    return wrapped
