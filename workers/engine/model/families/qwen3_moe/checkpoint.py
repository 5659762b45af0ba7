"""Qwen3-MoE's checkpoint names: those the families share (loader.DecoderNames) plus its experts, one tensor per expert
and projection as published (`mlp.experts.7.up_proj.weight` [out, in]) or fused per layer as transformers 5 keeps
them in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); both fill the stacked
kernels [E, in, out] of moe.ExpertLinear."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from ...loader import DecoderNames
from .. import ModelConfig, StatePath

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class ExpertNames(DecoderNames):
    """Collects expert tensors (per-expert or fused) into stacked [E, in, out] host arrays, then hands them over."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.stacks: dict[StatePath, np.ndarray] = {}
        self.seen: dict[StatePath, set[int]] = {}

    def _stack(self, layer: int, proj: str) -> tuple[StatePath, np.ndarray]:
        c = self.config
        if not c.is_moe_layer(layer):
            raise ValueError(f"checkpoint has experts for layer {layer}, which the config makes a dense MLP layer")
        path = ("layers", layer, "mlp", "experts", proj, "kernel")
        if path not in self.stacks:
            h, i = c.hidden_size, c.moe_intermediate_size
            shape = (c.num_experts, i, h) if proj == "down_proj" else (c.num_experts, h, i)
            self.stacks[path] = np.zeros(shape, np.float32)
            self.seen[path] = set()
        return path, self.stacks[path]

    def _put(self, layer: int, proj: str, expert: int | None, value: np.ndarray, name: str) -> None:
        path, stack = self._stack(layer, proj)
        want = stack.shape if expert is None else stack.shape[1:]
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(want)}")
        if expert is None:
            stack[...] = value
            self.seen[path].update(range(stack.shape[0]))
        else:
            if not 0 <= expert < stack.shape[0]:
                raise ValueError(f"{name}: expert {expert} out of range (num_experts={stack.shape[0]})")
            stack[expert] = value
            self.seen[path].add(expert)

    def gather(self, name: str, read: Callable[[], np.ndarray]) -> bool:
        """Consume `name` if it is an expert tensor; False otherwise."""
        m = _EXPERT.match(name)
        if m is not None:
            tensor = np.asarray(read(), np.float32)  # [out, in]
            self._put(int(m.group(1)), m.group(3), int(m.group(2)), tensor.T, name)
            return True
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            return False
        layer, tensor = int(m.group(1)), np.asarray(read(), np.float32)
        if m.group(2) == "down_proj":  # [E, H, I]
            self._put(layer, "down_proj", None, tensor.transpose(0, 2, 1), name)
        else:  # [E, 2I, H]: gate rows first, then up (transformers' chunk(2))
            half = tensor.shape[1] // 2
            self._put(layer, "gate_proj", None, tensor[:, :half].transpose(0, 2, 1), name)
            self._put(layer, "up_proj", None, tensor[:, half:].transpose(0, 2, 1), name)
        return True

    def gathered(self) -> Iterator[tuple[StatePath, np.ndarray]]:
        for path, stack in self.stacks.items():
            absent = sorted(set(range(stack.shape[0])) - self.seen[path])
            if absent:
                raise ValueError(f"checkpoint lacks {'.'.join(map(str, path[:-1]))} for experts {absent[:5]}")
            yield path, stack
