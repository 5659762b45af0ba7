"""The unembedding LoRA (train_unembed) means one thing in the engine, its export and tinker-cookbook's merge.

The export names it as Tinker's own exports do (`base_model.model.model.unembed_tokens.lora_{A,B}.weight`), the name
`tinker_cookbook.weights.build_hf_model` maps to `lm_head` (untied model) or to the shared `model.embed_tokens`
(tied embeddings: the tiny model, Qwen3-0.6B). On a tied model the adapter is an update of that shared matrix, so the
engine adds it to the embedding lookup as well as to the logits: the cookbook's merged model in transformers then
gives the engine's logprobs, from the trainer and from the sampler, with both of the cookbook's merge strategies.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MAX_RANK
from safetensors.numpy import load_file

from tinkerflow.workers.engine.model.checkpoint import ADAPTER_WEIGHTS, read_peft, write_peft
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, InputError, LoraConfig, SampleInput

# As test_parity.py: float32 on both sides, different summation orders.
TOL = 1e-4
TOKENS = np.array([5, 17, 42, 99, 3, 250, 7, 11, 64, 2, 9], np.int32)
UNEMBED_KEYS = {
    "base_model.model.model.unembed_tokens.lora_A.weight",
    "base_model.model.model.unembed_tokens.lora_B.weight",
}


@pytest.fixture(scope="module")
def tied(make_checkpoint, tmp_path_factory):
    """(model dir, engine) of the tiny Qwen3 with tied embeddings; the session engine's model is untied."""
    from tinkerflow.workers.engine.engine import Engine

    directory = make_checkpoint(tmp_path_factory.mktemp("qwen3-tied"), tie=True)
    return directory, Engine.load(str(directory), max_lora_adapters=2, max_lora_rank=MAX_RANK, progress=False)


def _logprobs(engine, slot, tokens):
    datum = Datum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    [res] = engine.forward_backward(
        [ForwardBackwardInput(slot=slot, data=[datum], loss_fn="cross_entropy", forward_only=True)]
    )
    return res.outputs[0]["logprobs"]


def _random_adapter(engine, slot, config, rng):
    """Random A and B for the trained modules, zero elsewhere (a fresh adapter's B is zero: it would merge to
    nothing)."""
    engine.create_adapter(slot, config)
    live = {"self_attn": config.train_attn, "mlp": config.train_mlp, "lm_head": config.train_unembed}
    weights = {
        k: rng.normal(0, 0.2, v.shape).astype(np.float32)
        if any(on and g in k for g, on in live.items())
        else np.zeros_like(v)
        for k, v in engine.adapter_weights(slot).items()
    }
    engine.set_adapter_weights(slot, weights)
    return weights


def _merged_logprobs(model_dir, adapter_dir, out_dir, strategy, tokens):
    import torch
    from tinker_cookbook.weights import build_hf_model
    from transformers import AutoModelForCausalLM

    build_hf_model(
        base_model=str(model_dir),
        adapter_path=str(adapter_dir),
        output_path=str(out_dir),
        dtype="float32",
        merge_strategy=strategy,
        device="cpu",
    )
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[None, :-1]).long()).logits[0]
    lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(tokens[1:]).long()[:, None])[:, 0]
    return lp.numpy()


def _adapter_logprobs(model_dir, adapter_dir, out_dir, tokens):
    import peft
    import torch
    from tinker_cookbook.weights import build_lora_adapter
    from transformers import AutoModelForCausalLM

    build_lora_adapter(base_model=str(model_dir), adapter_path=str(adapter_dir), output_path=str(out_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(out_dir)).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[None, :-1]).long()).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(tokens[1:]).long()[:, None])[:, 0].numpy()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_cookbook_merge_of_unembed_adapter_matches_engine(tie, tied, qwen3_dir, engine, rng, tmp_path):
    pytest.importorskip("tinker_cookbook", reason="the cookbook extra is not installed")
    model_dir, eng = tied if tie else (qwen3_dir, engine)
    config = LoraConfig(rank=4, seed=1, train_attn=False, train_mlp=True, train_unembed=True)
    weights = _random_adapter(eng, 0, config, rng)
    write_peft(config, weights, tmp_path / "adapter", base_model_name_or_path=str(model_dir))
    keys = set(load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS)))
    assert keys >= UNEMBED_KEYS and not any("lm_head" in k for k in keys)

    ours = _logprobs(eng, 0, TOKENS)
    eng.create_adapter(1, LoraConfig(rank=1, train_attn=False, train_mlp=False, train_unembed=False))
    assert np.abs(ours - _logprobs(eng, 1, TOKENS)).max() > 100 * TOL, "the adapter must change the logprobs"
    for strategy in ("full", "shard"):  # full: tied lm_head.weight in the state dict; shard: embed_tokens
        merged = _merged_logprobs(model_dir, tmp_path / "adapter", tmp_path / strategy, strategy, TOKENS)
        np.testing.assert_allclose(ours, merged, atol=TOL, rtol=TOL, err_msg=strategy)

    # The sampler computes the same model (a snapshot, prompt logprobs), and the export reads back as it was.
    eng.snapshot(0, "unembed")
    try:
        [res] = eng.sample(
            [
                SampleInput(
                    prompt=TOKENS, max_tokens=1, stop_token_ids=[], snapshot="unembed", include_prompt_logprobs=True
                )
            ]
        )
    finally:
        eng.drop_snapshot("unembed")
    np.testing.assert_allclose(res.prompt_logprobs[1:], ours, atol=TOL, rtol=TOL)
    if not tie:  # PEFT and vLLM take it through the cookbook's build_lora_adapter: unembed_tokens -> lm_head
        np.testing.assert_allclose(
            ours, _adapter_logprobs(model_dir, tmp_path / "adapter", tmp_path / "peft", TOKENS), atol=TOL, rtol=TOL
        )
    read_config, read_weights = read_peft(tmp_path / "adapter")
    assert read_config == LoraConfig(rank=4, train_attn=False, train_mlp=True, train_unembed=True)
    for name in ("lm_head.lora_a", "lm_head.lora_b"):
        np.testing.assert_array_equal(read_weights[name], weights[name])


def test_peft_lm_head_name_reads_as_the_unembedding_adapter(engine, rng, tmp_path):
    """An adapter PEFT saved itself names the unembedding `base_model.model.lm_head`: read as the same adapter; both
    names at once is refused rather than one silently winning."""
    import json

    config = LoraConfig(rank=4, seed=2, train_attn=False, train_mlp=False, train_unembed=True)
    weights = _random_adapter(engine, 0, config, rng)
    write_peft(config, weights, tmp_path, base_model_name_or_path="x")
    tensors = load_file(str(tmp_path / ADAPTER_WEIGHTS))
    peft_named = {
        k.replace("base_model.model.model.unembed_tokens.", "base_model.model.lm_head."): v for k, v in tensors.items()
    }
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert raw["target_modules"] == ["unembed_tokens"]
    (tmp_path / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": ["lm_head"]}))
    from safetensors.numpy import save_file

    save_file(peft_named, str(tmp_path / ADAPTER_WEIGHTS))
    read_config, read_weights = read_peft(tmp_path)
    assert read_config == LoraConfig(rank=4, train_attn=False, train_mlp=False, train_unembed=True)
    for name in ("lm_head.lora_a", "lm_head.lora_b"):
        np.testing.assert_array_equal(read_weights[name], weights[name])

    save_file({**tensors, **peft_named}, str(tmp_path / ADAPTER_WEIGHTS))
    with pytest.raises(InputError, match="there twice"):
        read_peft(tmp_path)
