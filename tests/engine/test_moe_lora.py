# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
r"""LoRA on Qwen3-MoE: PEFT parity (logprobs and gradients), fresh adapter == base, adapter isolation, module groups,
PEFT export/import, and sampling through the KV-cache sampler against transformers' greedy generate.

PEFT and transformers 5: the experts are no longer per-expert nn.Linear (they are fused parameters,
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]), so PEFT 0.21 reaches them through
`target_parameters`, one adapter per expert. On the fused gate_up PEFT itself doubles rank and alpha
(rank_pattern/alpha_pattern `.*\.gate_up_proj`), which is how it carries per-expert gate_proj and up_proj adapters
(its layout on transformers 4's per-expert linears, and ours) over to the fused weight: A = [A_gate; A_up] and a
block-diagonal B, same alpha / r. The test builds that PEFT model with our weights in those blocks and compares
logprobs and every gradient block we have, to the dense tolerance (1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
from cookbook_merge import merged_and_base_logprobs
from moe_checkpoint import EXPERTS, MOE_INTER, build_moe_model

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.checkpoint import read_peft, write_peft
from tinkerflow.workers.engine.types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardResult,
    LoraConfig,
    SampleInput,
)

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")

TOL = 1e-4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_moe_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", seed=6)


@pytest.fixture(scope="module")
def moe_engine(moe_dir):
    return Engine.load(str(moe_dir), max_lora_adapters=3, max_lora_rank=8, progress=False)


def _hf(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _ce(slot, tokens, weights=None, forward_only=False):
    tokens = np.asarray(tokens, np.int32)
    inputs = {"target_tokens": tokens[1:]}
    if weights is not None:
        inputs["weights"] = weights
    return ForwardBackwardInput(
        slot=slot, data=[Datum(tokens=tokens[:-1], inputs=inputs)], loss_fn="cross_entropy", forward_only=forward_only
    )


def _assert_grads_close(actual, desired):
    assert actual.keys() == desired.keys()
    for k in desired:
        scale = float(np.abs(desired[k]).max())
        np.testing.assert_allclose(actual[k], desired[k], rtol=1e-5, atol=1e-5 * scale + 1e-9, err_msg=k)


def test_fresh_adapter_equals_base_and_transformers(moe_engine, moe_dir):
    e = moe_engine
    e.create_adapter(0, LoraConfig(rank=4, seed=0, train_attn=False, train_mlp=False, train_unembed=False))
    e.create_adapter(1, LoraConfig(rank=8, seed=0))
    weights = e.adapter_weights(1)
    assert weights["layers.0.mlp.experts.up_proj.lora_a"].shape == (EXPERTS, 64, 8)
    assert weights["layers.0.mlp.experts.down_proj.lora_b"].shape == (EXPERTS, 8, 64)
    assert not any(".mlp.gate." in k for k in weights), "the router has no LoRA (frozen, as PEFT leaves it)"
    a = weights["layers.0.mlp.experts.gate_proj.lora_a"]
    assert np.all(a != 0) and not np.array_equal(a[0], a[1]), "each expert draws its own A"
    tokens = np.random.default_rng(3).integers(1, 300, size=16)
    base, fresh = e.forward_backward([_ce(0, tokens, forward_only=True), _ce(1, tokens, forward_only=True)])
    np.testing.assert_array_equal(base.outputs[0]["logprobs"], fresh.outputs[0]["logprobs"])
    with torch.no_grad():
        logits = _hf(moe_dir)(torch.from_numpy(tokens[None, :-1]).long()).logits[0]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(tokens[1:]).long()[:, None])[:, 0].numpy()
    np.testing.assert_allclose(base.outputs[0]["logprobs"], ref, atol=TOL, rtol=TOL)


def _peft_model(directory, rank: int):
    import peft

    config = peft.LoraConfig(
        # PEFT 0.21 leaves the dense (mlp_only) layer's gate/up/down_proj unwrapped once expert parameters are
        # targeted (a list or a regex alike); that layer is our dense LoRALinear, whose PEFT parity test_parity.py has.
        r=rank,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        # What PEFT sets itself when gate_proj/up_proj are targets: the fused gate_up at twice the rank and alpha.
        rank_pattern={r".*\.gate_up_proj": 2 * rank},
        alpha_pattern={r".*\.gate_up_proj": 64},
    )
    return peft.get_peft_model(_hf(directory), config)


def _peft_modules(model):
    """(our module name, PEFT module, kind) for every LoRA of the PEFT model; kind: linear / gate_up / down."""
    from peft.tuners.lora.layer import ParamWrapper

    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        ours = "lm_head" if name.endswith("lm_head") else "layers." + name.split(".layers.", 1)[1]
        if isinstance(module, ParamWrapper):
            layer = ours.split(".mlp.")[0]
            kind = "gate_up" if module.parameter_name == "gate_up_proj" else "down"
            yield f"{layer}.mlp.experts", module, kind
        else:
            yield ours, module, "linear"


def test_lora_logprobs_and_grads_match_peft(moe_engine, moe_dir):
    rank = 4
    e = moe_engine
    e.create_adapter(2, LoraConfig(rank=rank, seed=7))
    e.create_adapter(0, LoraConfig(rank=2, seed=8))  # a neighbour, to show routing picks slot 2
    rng = np.random.default_rng(5)
    ours = {k: rng.normal(0, 0.2, v.shape).astype(np.float32) for k, v in e.adapter_weights(2).items()}
    for k in ours:  # the dense layer's MLP, which PEFT does not wrap here (see _peft_model)
        if k.startswith("layers.1.mlp."):
            ours[k][...] = 0.0
    e.set_adapter_weights(2, ours)

    model = _peft_model(moe_dir, rank)
    t = torch.from_numpy
    seen = set()
    with torch.no_grad():
        for name, module, kind in _peft_modules(model):
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.zero_()  # pyright: ignore[reportCallIssue] (transformers' module stubs)
            b.zero_()  # pyright: ignore[reportCallIssue] (transformers' module stubs)
            if kind == "linear":
                a[:rank] = t(ours[f"{name}.lora_a"].T)  # pyright: ignore[reportIndexIssue] (transformers' module stubs)
                b[:, :rank] = t(ours[f"{name}.lora_b"].T)  # pyright: ignore[reportIndexIssue] (transformers' module stubs)
                seen.add(name)
                continue
            # PEFT's expert e: A.weight.reshape(E, R, in)[e] [R, in]; B.weight.reshape(out, R, E)[..., e] [out, R].
            r2 = a.shape[0] // EXPERTS  # pyright: ignore[reportIndexIssue] (transformers' module stubs)
            assert r2 == (2 * rank if kind == "gate_up" else rank), "PEFT doubles the rank of the fused gate_up only"
            a3, b3 = a.view(EXPERTS, r2, -1), b.view(b.shape[0], r2, EXPERTS)  # pyright: ignore[reportArgumentType, reportCallIssue, reportIndexIssue] (transformers' module stubs)
            if kind == "gate_up":
                for half, proj in enumerate(("gate_proj", "up_proj")):
                    rows, cols = slice(half * rank, (half + 1) * rank), slice(half * MOE_INTER, (half + 1) * MOE_INTER)
                    a3[:, rows] = t(ours[f"{name}.{proj}.lora_a"].transpose(0, 2, 1))
                    b3[cols, rows] = t(ours[f"{name}.{proj}.lora_b"].transpose(2, 1, 0))
                    seen.add(f"{name}.{proj}")
            else:
                a3[:, :rank] = t(ours[f"{name}.down_proj.lora_a"].transpose(0, 2, 1))
                b3[:, :rank] = t(ours[f"{name}.down_proj.lora_b"].transpose(2, 1, 0))
                seen.add(f"{name}.down_proj")
    assert {k.rsplit(".lora_", 1)[0] for k in ours if not k.startswith("layers.1.mlp.")} == seen

    tokens = rng.integers(0, 300, size=15).astype(np.int32)
    w = rng.uniform(-0.5, 1.0, size=14).astype(np.float32)
    logits = model(t(tokens[None, :-1]).long()).logits[0]
    ref_lp = torch.log_softmax(logits, -1).gather(-1, t(tokens[1:]).long()[:, None])[:, 0]
    (-(ref_lp * t(w)).sum()).backward()

    [res] = e.forward_backward([_ce(2, tokens, w)])
    np.testing.assert_allclose(res.outputs[0]["logprobs"], ref_lp.detach().numpy(), atol=TOL, rtol=TOL)
    grads = e.accumulated_grads(2)
    checked = 0

    def check(name, got, want):
        nonlocal checked
        np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=name)
        checked += 1

    for name, module, kind in _peft_modules(model):
        ga, gb = module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad
        if kind == "linear":
            check(f"{name}.a", grads[f"{name}.lora_a"], ga.numpy()[:rank].T)  # pyright: ignore[reportCallIssue] (transformers' module stubs)
            check(f"{name}.b", grads[f"{name}.lora_b"], gb.numpy()[:, :rank].T)  # pyright: ignore[reportCallIssue] (transformers' module stubs)
            continue
        r2 = ga.shape[0] // EXPERTS  # pyright: ignore[reportIndexIssue] (transformers' module stubs)
        ga3, gb3 = ga.view(EXPERTS, r2, -1).numpy(), gb.view(gb.shape[0], r2, EXPERTS).numpy()  # pyright: ignore[reportArgumentType, reportCallIssue, reportIndexIssue] (transformers' module stubs)
        halves = [("gate_proj", 0), ("up_proj", 1)] if kind == "gate_up" else [("down_proj", 0)]
        for proj, half in halves:
            rows = slice(half * rank, (half + 1) * rank)
            cols = slice(half * MOE_INTER, (half + 1) * MOE_INTER) if kind == "gate_up" else slice(None)
            check(f"{name}.{proj}.a", grads[f"{name}.{proj}.lora_a"], ga3[:, rows].transpose(0, 2, 1))
            check(f"{name}.{proj}.b", grads[f"{name}.{proj}.lora_b"], gb3[cols, rows].transpose(2, 1, 0))
    assert checked == 2 * len(seen)
    assert all(np.all(g == 0) for g in e.accumulated_grads(0).values())
    assert np.any(grads["layers.0.mlp.experts.up_proj.lora_b"] != 0)


def test_grads_of_one_adapter_ignore_other_adapters_examples(moe_engine):
    e = moe_engine
    rng = np.random.default_rng(11)
    mine = [rng.integers(1, 300, 12) for _ in range(2)]
    grads = []
    for other in ([rng.integers(1, 300, 10)], [rng.integers(1, 300, 14) for _ in range(2)]):
        e.create_adapter(0, LoraConfig(rank=4, seed=1))
        e.create_adapter(1, LoraConfig(rank=4, seed=2))
        reqs = [_ce(1, s) for s in other] + [_ce(0, s) for s in mine]
        e.forward_backward(reqs)
        grads.append(e.accumulated_grads(0))
    _assert_grads_close(grads[1], grads[0])
    assert np.any(grads[0]["layers.2.mlp.experts.down_proj.lora_b"] != 0)


def test_optim_step_trains_every_routed_expert_within_rank_and_honours_train_mlp(moe_engine):
    e = moe_engine
    e.create_adapter(0, LoraConfig(rank=2, seed=1, train_mlp=False))
    e.create_adapter(1, LoraConfig(rank=3, seed=2))
    rng = np.random.default_rng(2)
    for _ in range(2):
        e.forward_backward([_ce(0, rng.integers(1, 300, 40)), _ce(1, rng.integers(1, 300, 40))])
        e.optim_step(0, AdamConfig(learning_rate=1e-2))
        e.optim_step(1, AdamConfig(learning_rate=1e-2))
    for k, v in e.adapter_weights(0).items():
        if ".mlp." in k:
            assert np.all(v == 0), f"{k}: train_mlp=False must stay zero"
        elif k.endswith("lora_b"):
            assert np.any(v != 0), f"{k} should have trained"
    trained = e.adapter_weights(1)
    b = trained["layers.0.mlp.experts.down_proj.lora_b"]  # [E, rank, out]
    assert b.shape == (EXPERTS, 3, 64)
    assert sum(np.any(b[x] != 0) for x in range(EXPERTS)) >= EXPERTS // 2, "routed experts train their own B"
    # Beyond the rank everything stays exactly zero (the untrimmed state).
    import jax

    for path, leaf in jax.tree_util.tree_flatten_with_path(e.adapters.lora)[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        full = np.asarray(leaf[1])
        tail = full[..., 3:] if "lora_a" in name else full[..., 3:, :]
        assert np.all(tail == 0), name


def test_peft_export_import_round_trip(moe_engine, tmp_path):
    e = moe_engine
    config = LoraConfig(rank=4, seed=3)
    e.create_adapter(1, config)
    rng = np.random.default_rng(9)
    weights = {k: rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in e.adapter_weights(1).items()}
    e.set_adapter_weights(1, weights)
    write_peft(config, e.adapter_weights(1), tmp_path / "peft", base_model_name_or_path="tiny-moe")
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    # Hosted Tinker's expert layout (tinker-cookbook's weights tools read it): w3 is up_proj, A [E, r, in].
    assert tensors["base_model.model.model.layers.0.mlp.experts.w3.lora_A.weight"].shape == (EXPERTS, 4, 64)
    assert "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight" in tensors  # the dense layer
    back_config, back = read_peft(tmp_path / "peft")
    assert back_config.rank == 4 and back.keys() == weights.keys()
    for k in weights:
        np.testing.assert_array_equal(back[k], weights[k], err_msg=k)

    # The same experts one tensor each (PEFT's per-expert names, as build_lora_adapter writes for vLLM) read the same.
    from safetensors.numpy import save_file

    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    per_expert = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if "experts" not in parts:
            per_expert[key] = value
            continue
        at = parts.index("experts")
        for expert in range(value.shape[0]):
            key_of_one = [*parts[: at + 1], str(expert), names[parts[at + 1]], *parts[at + 2 :]]
            per_expert[".".join(key_of_one)] = value[expert]
    save_file(per_expert, str(tmp_path / "peft" / "adapter_model.safetensors"))
    _, again = read_peft(tmp_path / "peft")
    for k in weights:
        np.testing.assert_array_equal(again[k], weights[k], err_msg=k)
    e.create_adapter(2, config)
    e.set_adapter_weights(2, back)  # loads back into the engine with the right shapes


@pytest.mark.slow
def test_greedy_sampling_matches_transformers_generate(moe_engine, moe_dir):
    """The KV-cache sampler (prefill + decode, two prompts of different lengths in one batch) on the base model."""
    e = moe_engine
    e.create_adapter(0, LoraConfig(rank=2, seed=0))
    e.snapshot(0, "moe-base")
    prompts = [np.array([5, 17, 42, 99, 3, 250, 7], np.int32), np.array([11, 12, 13], np.int32)]
    results = e.sample(
        [SampleInput(prompt=p, max_tokens=8, temperature=0.0, stop_token_ids=[], snapshot="moe-base") for p in prompts]
    )
    e.drop_snapshot("moe-base")
    hf = _hf(moe_dir)
    for p, res in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.from_numpy(p[None]).long(), max_new_tokens=8, do_sample=False, min_new_tokens=8)  # pyright: ignore[reportAttributeAccessIssue] (transformers' module stubs)
        assert list(res.sequences[0].tokens) == out[0, len(p) :].tolist()


def test_export_merges_through_the_cookbook_with_the_engines_logprobs(tmp_path):
    """tinker-cookbook's build_hf_model (what `weights.download` → merge runs) reads the export's Tinker expert layout
    and merges it into transformers' Qwen3-MoE: the merged model gives the engine's logprobs.

    With a moe_intermediate of 48: at the usual 32, 2 · moe_intermediate equals hidden and the cookbook takes the
    fused gate_up's wrong axis (its `_detect_fused_axis` tries [E, hidden, 2I] first), which no published
    Qwen3-MoE's shapes allow."""
    pytest.importorskip("tinker_cookbook", reason="the cookbook extra is not installed")
    directory = build_moe_model(tmp_path / "qwen3-moe", seed=12, moe_inter=48)
    e = Engine.load(str(directory), max_lora_adapters=2, max_lora_rank=8, progress=False)
    config = LoraConfig(rank=4, seed=5, train_attn=True, train_mlp=True, train_unembed=True)
    e.create_adapter(1, config)
    rng = np.random.default_rng(11)
    weights = {k: rng.normal(0, 0.2, v.shape).astype(np.float32) for k, v in e.adapter_weights(1).items()}
    e.set_adapter_weights(1, weights)
    tokens = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], np.int32)
    [res] = e.forward_backward([_ce(1, tokens, forward_only=True)])
    assert isinstance(res, ForwardBackwardResult), res
    ours = res.outputs[0]["logprobs"]
    write_peft(config, weights, tmp_path / "adapter", base_model_name_or_path=str(directory))
    merged, unmerged = merged_and_base_logprobs(directory, tmp_path / "adapter", tmp_path / "merged", tokens)
    assert np.abs(ours - unmerged).max() > 100 * TOL, "the adapter moves the logprobs, so the check bites"
    np.testing.assert_allclose(ours, merged, atol=TOL, rtol=TOL)
