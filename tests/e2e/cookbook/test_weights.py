"""tinker_cookbook.weights, unmodified: download() of a training checkpoint (through an age-encrypted external
export it decrypts and deletes) and of external weights, then build_hf_model (the merged model's logprobs in
transformers match the service's) and build_lora_adapter (PEFT loads it, same logprobs)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.cookbook.conftest import require_cookbook

require_cookbook()

PEFT_TOL = 1e-4  # as tests/e2e/test_checkpoints.py: fp32 service vs fp32 transformers on the tiny model
TOKENS = [[5, 17, 42, 99, 3, 250, 7, 11], [8, 1, 300, 64, 2, 9]]


def _data():
    from tinker import types

    return [
        types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs={"target_tokens": t[1:]})  # pyright: ignore[reportArgumentType] (Datum converts lists)
        for t in TOKENS
    ]


def _reference_logprobs(model, torch) -> list[np.ndarray]:
    out = []
    for t in TOKENS:
        with torch.no_grad():
            logits = model(torch.tensor([t[:-1]])).logits[0]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(t[1:])[:, None])[:, 0].numpy())
    return out


@pytest.mark.timeout(1200)
def test_download_build_hf_model_and_build_lora_adapter(cookbook_env, base_model, service_client, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import tinker
    from tinker import types
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter, download
    from transformers import AutoModelForCausalLM

    # train_unembed=False: build_lora_adapter's PEFT files cannot hold an unembedding adapter (Tinker's name for it,
    # unembed_tokens, is the cookbook merge's); the train_unembed merge is the test below.
    training = service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=3, train_unembed=False
    ).result()
    for _ in range(3):
        training.forward_backward(_data(), "cross_entropy").result(timeout=300)
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=300)
    ours = [
        np.asarray(o["logprobs"].data)
        for o in training.forward(_data(), "cross_entropy").result(timeout=300).loss_fn_outputs
    ]
    state = training.save_state("for-download").result(timeout=300).path
    external = training.save_weights_external("plain-export").result(timeout=300).path
    base_dir = training.get_info().model_data.tokenizer_id  # the served directory

    # A training checkpoint: the cookbook exports it age-encrypted to a fresh key, decrypts, deletes the export.
    adapter = tmp_path / "adapter"
    download(tinker_path=state, output_dir=str(adapter), base_url=cookbook_env.base_url)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    rest = tinker.ServiceClient(base_url=cookbook_env.base_url, api_key=cookbook_env.api_key).create_rest_client()
    left = [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert not any(p.endswith("/external_weights/download") for p in left), left  # the export was deleted
    # External weights download as they are.
    plain = tmp_path / "plain"
    download(tinker_path=external, output_dir=str(plain), base_url=cookbook_env.base_url)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (plain / name).read_bytes() == (adapter / name).read_bytes()

    merged = tmp_path / "merged"
    build_hf_model(base_model=base_dir, adapter_path=str(adapter), output_path=str(merged), dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(str(merged), torch_dtype=torch.float32).eval()
    for got, ref in zip(ours, _reference_logprobs(model, torch)):
        np.testing.assert_allclose(got, ref, atol=PEFT_TOL, rtol=PEFT_TOL)

    lora_dir = tmp_path / "peft"
    build_lora_adapter(base_model=base_dir, adapter_path=str(adapter), output_path=str(lora_dir))
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(lora_dir)).eval()
    for got, ref in zip(ours, _reference_logprobs(model, torch)):
        np.testing.assert_allclose(got, ref, atol=PEFT_TOL, rtol=PEFT_TOL)


@pytest.mark.timeout(1200)
def test_train_unembed_checkpoint_merges_into_the_samplers_model(cookbook_env, base_model, service_client, tmp_path):
    """train_unembed=True (the SDK's default) on the embedded model, whose embeddings are tied: the training
    checkpoint downloads with the unembedding LoRA under Tinker's `unembed_tokens` name, the cookbook merges it into
    the shared embedding matrix, and that model's logprobs in transformers are the service sampler's on the same
    weights (sampler checkpoint) and the trainer's."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from tinker import types
    from tinker_cookbook.weights import build_hf_model, download
    from transformers import AutoModelForCausalLM

    training = service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=7, train_unembed=True
    ).result()
    for _ in range(3):
        training.forward_backward(_data(), "cross_entropy").result(timeout=300)
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=300)
    ours = [
        np.asarray(o["logprobs"].data)
        for o in training.forward(_data(), "cross_entropy").result(timeout=300).loss_fn_outputs
    ]
    sampler = training.save_weights_and_get_sampling_client("unembed")
    sampled = [sampler.compute_logprobs(types.ModelInput.from_ints(t)).result(timeout=300) for t in TOKENS]
    state = training.save_state("unembed").result(timeout=300).path
    base_dir = training.get_info().model_data.tokenizer_id

    adapter = tmp_path / "adapter"
    download(tinker_path=state, output_dir=str(adapter), base_url=cookbook_env.base_url)
    keys = set(load_file(str(adapter / "adapter_model.safetensors")))
    assert "base_model.model.model.unembed_tokens.lora_B.weight" in keys, sorted(keys)[:5]
    merged = tmp_path / "merged"
    build_hf_model(base_model=base_dir, adapter_path=str(adapter), output_path=str(merged), dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(str(merged), torch_dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings  # the case where the merge lands in the shared matrix
    for got, from_sampler, ref in zip(ours, sampled, _reference_logprobs(model, torch)):
        assert from_sampler[0] is None
        np.testing.assert_allclose(got, ref, atol=PEFT_TOL, rtol=PEFT_TOL)
        np.testing.assert_allclose(np.asarray(from_sampler[1:], np.float32), ref, atol=PEFT_TOL, rtol=PEFT_TOL)
