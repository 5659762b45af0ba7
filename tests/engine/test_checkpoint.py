"""Checkpoints: training state (orbax) resumes exactly, PEFT export loads in PEFT and back, snapshots from weights."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import MAX_RANK

from tinkerflow.workers.engine.model.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    read_peft,
    read_training_state,
    write_peft,
    write_training_state,
)
from tinkerflow.workers.engine.model.lora import LORA_ALPHA
from tinkerflow.workers.engine.types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    InputError,
    LoraConfig,
    SampleInput,
    SlotState,
)

# Per-token logprobs against PEFT/torch, as in test_parity.py: float32 on both sides, different summation orders.
TOL = 1e-4
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
GROUPS = {"attn": ("self_attn.",), "mlp": ("mlp.",), "unembed": ("lm_head.",)}
UNEMBED = "base_model.model.model.unembed_tokens."  # Tinker's name for the unembedding LoRA (test_unembed_export.py)


def ce(slot, tokens, *, forward_only=False):
    tokens = np.asarray(tokens, np.int32)
    datum = Datum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    return ForwardBackwardInput(slot=slot, data=[datum], loss_fn="cross_entropy", forward_only=forward_only)


def train_step(engine, slot, tokens):
    [res] = engine.forward_backward([ce(slot, tokens)])
    engine.optim_step(slot, ADAM)
    return res.metrics["loss:sum"]


def logprobs(engine, slot, tokens):
    [res] = engine.forward_backward([ce(slot, tokens, forward_only=True)])
    return res.outputs[0]["logprobs"]


def assert_peft_logprobs_match(engine, slot, model_dir, adapter_dir, tokens):
    ours = logprobs(engine, slot, tokens)
    np.testing.assert_allclose(ours, _peft_logprobs(model_dir, adapter_dir, tokens), atol=TOL, rtol=TOL)
    engine.create_adapter(3, LoraConfig(rank=1, train_attn=False, train_mlp=False, train_unembed=False))
    assert np.abs(ours - logprobs(engine, 3, tokens)).max() > 100 * TOL, "the adapter must change the logprobs"


def assert_named_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def random_weights(engine, slot, config, rng, std=0.2):
    """Non-zero A and B for the config's trained groups, zero elsewhere (names and shapes from the slot)."""
    trained = {"attn": config.train_attn, "mlp": config.train_mlp, "unembed": config.train_unembed}
    out = {}
    for name, value in engine.adapter_weights(slot).items():
        live = any(trained[g] and any(p in name for p in pats) for g, pats in GROUPS.items())
        out[name] = rng.normal(0, std, value.shape).astype(np.float32) if live else np.zeros_like(value)
    return out


# ---------------------------------------------------------------------------------------------------- training state


def test_resume_from_training_state_is_exact(engine, rng, tmp_path):
    """A slot trained 2 steps, saved with orbax and restored into another slot, then both trained the same 2 steps:
    bitwise-equal losses and weights. Exact (no tolerance) because both slots run the same compiled programs on
    identical values; only the traced slot index differs."""
    batches = [rng.integers(1, 300, size=12) for _ in range(4)]
    engine.create_adapter(0, LoraConfig(rank=4, seed=3))
    for tokens in batches[:2]:
        train_step(engine, 0, tokens)
    state = engine.export_slot(0)
    assert state.step == 2 and any(np.any(v != 0) for v in state.mu.values())

    engine.create_adapter(1, LoraConfig(rank=2, seed=9, train_mlp=False))  # other config: import must replace it
    engine.forward_backward([ce(1, batches[0])])  # pending gradients the import must drop
    write_training_state(state, tmp_path / "ckpt", base_model_name_or_path="tiny")
    assert json.loads((tmp_path / "ckpt" / ADAPTER_CONFIG).read_text())["r"] == 4
    restored = read_training_state(tmp_path / "ckpt")
    assert restored.config == state.config and restored.step == 2
    for field in ("weights", "mu", "nu"):
        assert_named_equal(getattr(restored, field), getattr(state, field))

    engine.import_slot(1, restored, optimizer=True)
    assert all(np.all(g == 0) for g in engine.accumulated_grads(1).values())
    assert engine.export_slot(1).step == 2
    for tokens in batches[2:]:
        assert train_step(engine, 0, tokens) == train_step(engine, 1, tokens)
    assert engine.export_slot(1).step == engine.export_slot(0).step == 4
    assert_named_equal(engine.adapter_weights(1), engine.adapter_weights(0))
    assert_named_equal(engine.export_slot(1).nu, engine.export_slot(0).nu)


def test_import_without_optimizer_restarts_adam(engine, rng):
    batches = [rng.integers(1, 300, size=12) for _ in range(3)]
    engine.create_adapter(0, LoraConfig(rank=4, seed=3))
    for tokens in batches[:2]:
        train_step(engine, 0, tokens)
    engine.import_slot(1, engine.export_slot(0), optimizer=False)
    fresh = engine.export_slot(1)
    assert fresh.step == 0 and all(np.all(v == 0) for v in [*fresh.mu.values(), *fresh.nu.values()])
    assert_named_equal(fresh.weights, engine.adapter_weights(0))

    assert train_step(engine, 0, batches[2]) == train_step(engine, 1, batches[2])  # same weights, same loss
    assert engine.export_slot(1).step == 1 and engine.export_slot(0).step == 3
    a, b = engine.adapter_weights(0), engine.adapter_weights(1)
    assert any(not np.array_equal(a[k], b[k]) for k in a), "a restarted Adam must update differently"


def test_untrained_groups_and_out_of_rank_stay_zero(engine, rng):
    config = LoraConfig(rank=3, train_attn=False)
    engine.create_adapter(2, LoraConfig(rank=8, seed=1))  # full-rank values everywhere before the import
    engine.set_adapter_weights(2, {k: v + 1 for k, v in engine.adapter_weights(2).items()})
    engine.import_slot(2, SlotState(config=config, weights={}, mu={}, nu={}, step=0), optimizer=True)
    full = engine.adapters.take_slot(
        engine.adapters.lora, np.int32(2)
    )  # the whole [(L,) in, max_rank] / [(L,) max_rank, out]
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(full))
    weights = random_weights(engine, 2, config, rng)
    engine.import_slot(2, SlotState(config=config, weights=weights, mu={}, nu={}, step=0), optimizer=False)
    train_step(engine, 2, rng.integers(1, 300, size=12))
    for path, x in jax.tree_util.tree_flatten_with_path(engine.adapters.take_slot(engine.adapters.lora, np.int32(2)))[
        0
    ]:
        x = np.asarray(x)
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        beyond = x[..., 3:] if "lora_a" in name else x[..., 3:, :]  # the rank axis (stacked layers: [L, ...])
        assert np.all(beyond == 0), name
        if "self_attn" in name:
            assert np.all(x == 0), name


# ---------------------------------------------------------------------------------------------------- PEFT


def _peft_logprobs(model_dir, adapter_dir, tokens):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[None, :-1]).long()).logits[0]
    lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(tokens[1:]).long()[:, None])[:, 0]
    return lp.numpy()


@pytest.mark.parametrize("train_mlp", [True, False])
def test_peft_export_loads_in_peft_and_back(engine, qwen3_dir, rng, tmp_path, train_mlp):
    """Attention and MLP adapters load in PEFT as they are; the unembedding adapter carries Tinker's name, which PEFT
    does not know (tinker-cookbook's build_lora_adapter renames it: test_unembed_export.py)."""
    pytest.importorskip("peft")
    config = LoraConfig(rank=4, seed=5, train_mlp=train_mlp, train_unembed=False)
    engine.create_adapter(1, config)
    weights = random_weights(engine, 1, config, rng)
    engine.set_adapter_weights(1, weights)
    write_peft(config, engine.adapter_weights(1), tmp_path, base_model_name_or_path=str(qwen3_dir))

    written = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    mlp = ["gate_proj", "up_proj", "down_proj"] if train_mlp else []
    assert set(written["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", *mlp}
    assert (written["r"], written["lora_alpha"], written["peft_type"]) == (4, LORA_ALPHA, "LORA")
    from safetensors.numpy import load_file

    keys = set(load_file(str(tmp_path / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 2 * (4 + len(mlp))

    assert_peft_logprobs_match(engine, 1, qwen3_dir, tmp_path, rng.integers(0, 300, size=13).astype(np.int32))

    read_config, read_weights = read_peft(tmp_path)
    assert read_config == LoraConfig(rank=4, train_mlp=train_mlp, train_unembed=False)  # no seed in PEFT
    assert_named_equal(
        read_weights, {k: v for k, v in weights.items() if (train_mlp or ".mlp." not in k) and "lm_head" not in k}
    )


def test_peft_keys_match_what_peft_saves(qwen3_dir, engine, tmp_path):
    """Our key set is PEFT's own for the same target modules (less the frozen lm_head base weight PEFT copies), the
    unembedding LoRA under Tinker's name (`model.unembed_tokens`) rather than PEFT's (`lm_head`)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    write_peft(LoraConfig(rank=4), engine.adapter_weights(0), tmp_path, base_model_name_or_path="x")
    cfg = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    reference = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32),
        peft.LoraConfig(
            r=4,
            lora_alpha=cfg["lora_alpha"],
            task_type="CAUSAL_LM",
            target_modules=[m.replace("unembed_tokens", "lm_head") for m in cfg["target_modules"]],
        ),
    )
    state = peft.get_peft_model_state_dict(reference)
    expected = {
        k.replace("base_model.model.lm_head.", UNEMBED): tuple(v.shape)
        for k, v in state.items()
        if "base_layer" not in k
    }
    from safetensors.numpy import load_file

    assert {k: v.shape for k, v in load_file(str(tmp_path / ADAPTER_WEIGHTS)).items()} == expected


def test_reads_an_adapter_saved_by_peft(engine, qwen3_dir, rng, tmp_path):
    """PEFT's own save_pretrained with its defaults for Qwen3 (q_proj and v_proj only, r=8, lora_alpha=8): the
    attn group is trained with k/o_proj zero, alpha/r is folded into B, and our logprobs match PEFT's."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32), peft.LoraConfig(task_type="CAUSAL_LM")
    )
    assert sorted(model.peft_config["default"].target_modules) == ["q_proj", "v_proj"]  # pyright: ignore[reportAttributeAccessIssue] (peft's stubs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(tmp_path)

    config, weights = read_peft(tmp_path)
    assert config == LoraConfig(rank=8, train_mlp=False, train_unembed=False)
    assert len(weights) == 2 * 2 * 2 and "layers.1.self_attn.v_proj.lora_b" in weights
    engine.import_slot(2, SlotState(config, weights, {}, {}, 0), optimizer=False)
    assert_peft_logprobs_match(engine, 2, qwen3_dir, tmp_path, rng.integers(0, 300, size=13).astype(np.int32))


def test_peft_alpha_is_folded_into_b(engine, rng, tmp_path):
    config = LoraConfig(rank=4)
    engine.create_adapter(0, config)
    weights = random_weights(engine, 0, config, rng)
    write_peft(config, weights, tmp_path, base_model_name_or_path="x")
    raw = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**raw, "lora_alpha": LORA_ALPHA / 2}))
    _, halved = read_peft(tmp_path)
    for k, v in weights.items():
        np.testing.assert_array_equal(halved[k], v * np.float32(0.5) if k.endswith("lora_b") else v, err_msg=k)


# ---------------------------------------------------------------------------------------------------- snapshots


def test_load_snapshot_samples_like_a_slot_snapshot(engine, rng, tmp_path):
    config = LoraConfig(rank=4, seed=2, train_unembed=False)
    engine.create_adapter(3, config)
    engine.set_adapter_weights(3, random_weights(engine, 3, config, rng, std=0.3))
    engine.snapshot(3, "from-slot")
    write_peft(config, engine.adapter_weights(3), tmp_path, base_model_name_or_path="x")
    engine.load_snapshot("from-peft", *read_peft(tmp_path))
    engine.free_adapter(3)  # the loaded snapshot never depended on the slot

    saved = engine.sample_slots
    engine.sample_slots = 8
    try:
        prompt = np.array([5, 17, 42, 99, 3, 250, 7], np.int32)
        reqs = [
            SampleInput(
                prompt=prompt,
                max_tokens=10,
                temperature=0.0,
                stop_token_ids=[],
                snapshot=s,
                include_prompt_logprobs=True,
            )
            for s in ("from-slot", "from-peft", None)
        ]
        slot_res, loaded_res, base_res = engine.sample(reqs)
    finally:
        engine.sample_slots = saved
        engine.drop_snapshot("from-slot")
        engine.drop_snapshot("from-peft")
    a, b = slot_res.sequences[0], loaded_res.sequences[0]
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(slot_res.prompt_logprobs[1:], loaded_res.prompt_logprobs[1:])
    assert not np.allclose(slot_res.prompt_logprobs[1:], base_res.prompt_logprobs[1:]), "the adapter must matter"


# ---------------------------------------------------------------------------------------------------- bad inputs


def test_bad_slot_states_are_refused_before_any_write(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    before = engine.export_slot(0)
    good = before.weights
    name = "layers.0.self_attn.q_proj.lora_a"
    cases = [
        (SlotState(LoraConfig(rank=MAX_RANK + 1), {}, {}, {}, 0), "must be in [1, 8] (max_lora_rank)"),
        (SlotState(before.config, {**good, name: good[name][:, :3]}, {}, {}, 0), f"weights {name}: shape (64, 3)"),
        (SlotState(before.config, {"layers.9.mlp.x.lora_a": good[name]}, {}, {}, 0), "unknown LoRA weights"),
        (SlotState(before.config, {**good, name: good[name] * np.nan}, {}, {}, 0), "non-finite"),
        (SlotState(before.config, good, {name: np.ones((64, 2), np.float32)}, {}, 1), f"mu {name}: shape (64, 2)"),
        (SlotState(LoraConfig(rank=4, train_attn=False), good, {}, {}, 0), "its attn group is not trained"),
        (SlotState(before.config, good, {}, {}, -1), "optimizer step -1"),
    ]
    for state, message in cases:
        with pytest.raises(InputError) as e:
            engine.import_slot(0, state, optimizer=True)
        assert message in str(e.value)
    with pytest.raises(InputError, match=r"shape \(64, 3\)"):
        engine.load_snapshot("bad", before.config, {name: good[name][:, :3]})
    with pytest.raises(InputError, match="max_lora_rank"):
        engine.load_snapshot("bad", LoraConfig(rank=MAX_RANK + 1), {})
    after = engine.export_slot(0)
    assert after.config == before.config and after.step == before.step
    assert_named_equal(after.weights, before.weights)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: "{not json", "is not valid JSON"),
        (lambda c: {**c, "peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING' is not supported"),
        (lambda c: {**c, "r": 0}, "r must be a positive integer"),
        (lambda c: {**c, "lora_alpha": -1}, "lora_alpha must be a positive number"),
        (lambda c: {**c, "target_modules": ["q_proj", "embed_tokens"]}, "target_modules ['embed_tokens']"),
        (lambda c: {**c, "target_modules": ".*proj"}, "target_modules must be a list"),
        (lambda c: {**c, "use_dora": True}, "use_dora=True is not supported"),
        (lambda c: {**c, "rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        (lambda c: {**c, "target_modules": ["q_proj"]}, "not in target_modules"),  # file has mlp/lm_head tensors
        (lambda c: {**c, "r": 5}, "not rank r=5"),
    ],
)
def test_malformed_peft_adapters_are_refused(engine, tmp_path, edit, message):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    write_peft(LoraConfig(rank=4), engine.adapter_weights(0), tmp_path, base_model_name_or_path="x")
    edited = edit(json.loads((tmp_path / ADAPTER_CONFIG).read_text()))
    (tmp_path / ADAPTER_CONFIG).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(InputError) as e:
        read_peft(tmp_path)
    assert message in str(e.value)


def test_missing_files_are_refused(engine, tmp_path):
    with pytest.raises(InputError, match=r"adapter_config\.json is missing"):
        read_peft(tmp_path)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    write_peft(LoraConfig(rank=4), engine.adapter_weights(0), tmp_path, base_model_name_or_path="x")
    with pytest.raises(InputError, match="not a training checkpoint"):
        read_training_state(tmp_path)
    (tmp_path / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(InputError, match=r"adapter_model\.safetensors is missing"):
        read_peft(tmp_path)
