"""The model-family registry (model/families/): how a config.json finds its family, what an unsupported one is told,
and that every family's answers fit together: its tiny checkpoint loads with every tensor used and every LoRA leaf in
a train group, and its logits match transformers'."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tinkerflow.workers.engine.model.families import ModelConfig, family_name_of, family_named, family_of, served_names
from tinkerflow.workers.engine.model.loader import load_model
from tinkerflow.workers.engine.model.lora import LoraRouting, module_kind
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model, tiny_families

TOL = 1e-4  # as test_parity.py: float32 logits of a tiny model against transformers'


def test_an_unsupported_architecture_is_one_line_naming_it_and_the_families_served():
    hf = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2}
    with pytest.raises(ValueError) as e:
        family_of(hf)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("unsupported architecture 'gpt_oss' (GptOssForCausalLM); families served: ")
    listed = message.split("families served: ", 1)[1]
    names = [entry.split(" (model_type")[0] for entry in listed.split("), ")]
    assert names == sorted(names) and {"llama3", "qwen3", "qwen3_moe"} <= set(names)
    assert "llama3 (model_type llama)" in listed  # the family and the model_type it reads, where they differ
    with pytest.raises(ValueError, match="unsupported architecture 'gpt_oss'"):
        ModelConfig.from_hf(hf)  # the engine's own entry says the same
    with pytest.raises(ValueError, match=r"unsupported architecture None \(no architectures listed\)"):
        family_name_of({})


@pytest.mark.parametrize("name", served_names())
def test_each_family_is_found_by_its_model_types_and_by_its_name(name):
    family = family_named(name)
    assert family.name == name
    for model_type in importlib.import_module(f"tinkerflow.workers.engine.model.families.{name}").MODEL_TYPES:
        assert family_name_of({"model_type": model_type}) == name and family_of({"model_type": model_type}) is family


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-families")
    return {name: make_tiny_model(root / name, family=name) for name in tiny_families()}


@pytest.mark.parametrize("name", tiny_families())
def test_tiny_checkpoint_loads_whole_with_every_lora_leaf_in_a_group(tiny_dirs, name):
    loaded = load_model(str(tiny_dirs[name]), max_adapters=2, max_rank=4, progress=False)  # lacks nothing
    assert loaded.config.arch == name
    kinds = {module_kind(path) for path, _ in nnx.to_flat_state(loaded.lora)}
    assert kinds == {"attn", "mlp", "unembed"}


@pytest.mark.parametrize("name", tiny_families())
def test_tiny_checkpoint_logits_match_transformers(tiny_dirs, name):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    directory = tiny_dirs[name]
    tokens = np.random.default_rng(0).integers(0, 2048, size=(2, 17)).astype(np.int32)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.abs(ref).max() > 1.0, "fixture logits are too flat to make this test meaningful"
    loaded = load_model(str(directory), max_adapters=1, max_rank=1, progress=False)
    model = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
    routing = LoraRouting(adapter=jnp.zeros((2,), jnp.int32), scale=jnp.zeros((2,), jnp.float32))
    ours = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(17), (2, 17)), routing)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=TOL, rtol=TOL)


def test_the_sampler_asks_the_family_what_it_caches(monkeypatch):
    """A family's recurrent layers get the family's own slot cache (model/slot_cache.py), its KV layers only keys and
    values: the sampler asks the family, never names it."""
    from tinkerflow.workers.engine.model import slot_cache

    qwen3 = family_named("qwen3")
    hybrid = dataclasses.replace(qwen3, cache_kinds=lambda c: ("recurrent", "kv")[: c.num_layers])
    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2}
    config = ModelConfig.from_hf({"model_type": "qwen3", "num_attention_heads": 2, "head_dim": 4, **shape})
    assert not slot_cache.recurrent(config) and slot_cache.kv_layers(config) == 2
    monkeypatch.setattr(slot_cache, "family_named", lambda name: hybrid)
    assert slot_cache.recurrent(config) and slot_cache.kv_layers(config) == 1
