"""tinker-cookbook's `build_hf_model` (what `weights.download` → merge runs) over an exported adapter, and the
logprobs transformers then gives a token sequence: merged, and on the base model alone (so a test can check that
the adapter moves them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _logprobs(directory: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[None, :-1]).long()).logits[0]
    target = torch.from_numpy(tokens[1:]).long()[:, None]
    return torch.log_softmax(logits, -1).gather(-1, target)[:, 0].numpy()


def merged_and_base_logprobs(base: Path, adapter: Path, out: Path, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logprobs of tokens[1:] after tokens[:-1] on the merged model, the same on the base model), float32."""
    from tinker_cookbook.weights import build_hf_model

    build_hf_model(
        base_model=str(base),
        adapter_path=str(adapter),
        output_path=str(out),
        dtype="float32",
        merge_strategy="full",
        device="cpu",
    )
    return _logprobs(out, tokens), _logprobs(base, tokens)


def vl_logprobs(
    directory: Path, tokens: np.ndarray, images: tuple = (), image_token_id: int | None = None
) -> np.ndarray:
    """Logprobs of tokens[1:] after tokens[:-1] from transformers' Qwen3_5ForConditionalGeneration loaded from
    `directory` (a vision-language checkpoint), with `images` (the engine's preprocessed images, in order) in the
    placeholders; float32."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = torch.from_numpy(tokens[None, :-1]).long()
    kwargs = {}
    if images:
        kwargs = dict(
            pixel_values=torch.from_numpy(np.concatenate([im.patches for im in images])),
            image_grid_thw=torch.tensor([im.grid for im in images]),
            mm_token_type_ids=(ids == image_token_id).int(),
        )
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0]
    target = torch.from_numpy(tokens[1:]).long()[:, None]
    return torch.log_softmax(logits, -1).gather(-1, target)[:, 0].numpy()
