"""Qwen3.5 checkpoints through the engine's real loader (loader.load_model), in both layouts transformers 5.23
saves: `Qwen3_5ForCausalLM` (`model.layers.*`) and `Qwen3_5ForConditionalGeneration` (`model.language_model.*`
beside a vision tower, which is loaded too), and their MoE twins (experts as transformers 5.23 saves them), sharded
safetensors, float32 and bfloat16 files. Logits equal transformers' at the whole-model tolerance of the qwen3_5
parity tests (qwen3_5_reference.LOGITS_L2 / TOKEN_L2)."""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qwen3_5_reference import VOCAB, hf_model, logits_close, positions, routing, text_config

from tinkerflow.workers.engine.model.families import family_name_of
from tinkerflow.workers.engine.model.loader import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
T = 21


def _composite(text, *, moe: bool):
    """transformers' vision-language model around `text` (a text config), with a tiny vision tower."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text.hidden_size)
    if moe:
        config = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision)
        return transformers.Qwen3_5MoeForConditionalGeneration(config).float().eval()
    config = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)
    return transformers.Qwen3_5ForConditionalGeneration(config).float().eval()


def _saved(tmp_path, layout: str, moe: bool, dtype=None):
    """(directory, transformers' model whose logits the checkpoint must give)."""
    causal = hf_model(text_config(moe=moe), seed=4)
    model = causal
    if layout == "conditional":
        model = _composite(causal.config, moe=moe)
        missing = model.load_state_dict(
            {
                ("model.language_model." + k[6:] if k.startswith("model.") else k): v
                for k, v in causal.state_dict().items()
            },
            strict=False,
        ).missing_keys
        assert all(k.startswith("model.visual.") for k in missing), missing[:3]
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    return tmp_path, model.float()


def _engine_logits(directory, tokens: np.ndarray, dtype=jnp.float32) -> np.ndarray:
    loaded = load_model(str(directory), max_adapters=2, max_rank=4, progress=False, dtype=dtype)
    model = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
    b, t = tokens.shape
    return np.asarray(model(jnp.asarray(tokens, jnp.int32), positions(t, b), routing(b)))


def _tokens(b: int = 2) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (b, T))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("layout", ["causal", "conditional"])
def test_both_layouts_load_to_transformers_logits(tmp_path, caplog, layout, moe):
    directory, model = _saved(tmp_path, layout, moe)
    assert len(list(directory.glob("*.safetensors"))) > 1  # sharded
    hf = json.loads((directory / "config.json").read_text())
    assert family_name_of(hf) == ("qwen3_5_moe" if moe else "qwen3_5")
    tokens = _tokens()
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    with caplog.at_level(logging.INFO):
        got = _engine_logits(directory, tokens)
    logits_close(got, want, f"{layout} {'moe' if moe else 'dense'}")
    told = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert told == []  # a composite checkpoint's tower is loaded (its tensors all placed), not skipped


def test_mtp_tensors_are_skipped_with_one_info_line(tmp_path, caplog):
    directory, model = _saved(tmp_path, "causal", False)
    from safetensors.numpy import save_file

    save_file(
        {"mtp.fc.weight": np.ones((4, 4), np.float32), "mtp.norm.weight": np.ones(4, np.float32)},
        str(directory / "mtp.safetensors"),
    )
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"].update({"mtp.fc.weight": "mtp.safetensors", "mtp.norm.weight": "mtp.safetensors"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    tokens = _tokens(1)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    with caplog.at_level(logging.INFO):
        logits_close(_engine_logits(directory, tokens), want, "with mtp")
    assert len([r for r in caplog.records if "multi-token-prediction" in r.getMessage()]) == 1


def test_bfloat16_checkpoint_loads_to_its_float32_logits(tmp_path):
    """A bf16 file (as released) read into float32 weights: the logits of the same bf16-rounded weights in
    transformers, in float32."""
    directory, model = _saved(tmp_path, "conditional", True, dtype=torch.bfloat16)
    # Read back in float32 (the bf16 round trip of the model in memory would round its rope buffer as well).
    model = type(model).from_pretrained(directory, dtype=torch.float32, experts_implementation="eager").eval()
    tokens = _tokens()
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    logits_close(_engine_logits(directory, tokens), want, "bf16 file")


def test_conv_weight_of_the_wrong_shape_is_refused(tmp_path):
    directory, _ = _saved(tmp_path, "causal", False)
    from safetensors.numpy import load_file, save_file

    for f in directory.glob("*.safetensors"):
        tensors = load_file(str(f))
        name = "model.layers.0.linear_attn.conv1d.weight"
        if name in tensors:
            tensors[name] = tensors[name][:, :, :3]
            save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.linear_attn\.conv1d\.weight: checkpoint shape"):
        load_model(str(directory), max_adapters=2, max_rank=4, progress=False)
