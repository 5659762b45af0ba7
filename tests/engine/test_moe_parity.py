"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: logits, and per layer the router's logits, its top-k choices
and weights, the expert mixture, attention and whole layers, each fed exactly the input its HF twin saw.

Tolerances are the dense ones (test_parity.py, test_parity_layers.py), never loosened: 1e-4 for logits and composite
modules, 1e-5 for simple ones (router logits, the routing weights); the chosen experts must be identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from moe_checkpoint import EXPERTS, build_moe_model, moe_layers

from tinkerflow.workers.engine.model.loader import load_model
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.moe import SparseMoeBlock, _blocked_grouped_matmul
from tinkerflow.workers.engine.model.rope import rope_tables

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")

SIMPLE, COMPOSITE = 1e-5, 1e-4

VARIANTS = {
    # Qwen3-30B-A3B's settings (norm_topk_prob) with one dense layer from mlp_only_layers, experts per tensor.
    "norm-mlp_only": dict(norm_topk_prob=True, mlp_only_layers=(1,), decoder_sparse_step=1),
    # Un-normalised top-k, every second layer sparse, experts fused as transformers 5 holds them, tied embeddings.
    "step2-fused-tied": dict(norm_topk_prob=False, mlp_only_layers=(), decoder_sparse_step=2, fused=True, tie=True),
}


def _ours(directory):
    loaded = load_model(str(directory), max_adapters=2, max_rank=4, progress=False)
    return nnx.merge(loaded.graphdef, loaded.lora, loaded.base)


def _base_routing(b: int) -> LoraRouting:
    return LoraRouting(adapter=jnp.zeros((b,), jnp.int32), scale=jnp.zeros((b,), jnp.float32))


def _capture(hf, tokens: np.ndarray) -> dict:
    seen: dict = {}

    def hook(name):
        def record(module, args, kwargs, output):
            seen[name] = (args, kwargs, output)

        return record

    for i, layer in enumerate(hf.model.layers):
        layer.register_forward_hook(hook(f"layer{i}"), with_kwargs=True)
        layer.self_attn.register_forward_hook(hook(f"layer{i}.self_attn"), with_kwargs=True)
        layer.mlp.register_forward_hook(hook(f"layer{i}.mlp"), with_kwargs=True)
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(hook(f"layer{i}.router"), with_kwargs=True)
    with torch.no_grad():
        seen["logits"] = hf(torch.from_numpy(tokens).long()).logits.numpy()
    return seen


def _np(x):
    x = x[0] if isinstance(x, tuple) else x
    return x.detach().numpy()


def _input(record) -> jax.Array:
    args, kwargs, _ = record
    return jnp.asarray(_np(args[0] if args else kwargs["hidden_states"]))


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=[pytest.mark.slow] if v != "norm-mlp_only" else []) for v in sorted(VARIANTS)]
)
def test_moe_matches_transformers_per_layer(tmp_path, variant):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    kw = VARIANTS[variant]
    directory = build_moe_model(tmp_path / variant, seed=4, **kw)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert isinstance(hf, Qwen3MoeForCausalLM)
    tokens = np.random.default_rng(2).integers(0, 300, size=(2, 12)).astype(np.int32)
    seen = _capture(hf, tokens)
    model = _ours(directory)
    sparse = moe_layers(list(kw["mlp_only_layers"]), kw["decoder_sparse_step"])
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [
        i in sparse for i in range(len(model.layers))
    ]
    b, t = tokens.shape
    routing = _base_routing(b)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    rope = rope_tables(model.config, positions)
    used = set()
    for i, layer in enumerate(model.layers):
        x_mlp = _input(seen[f"layer{i}.mlp"])
        if i in sparse:
            ref_logits, ref_weights, ref_experts = (o.detach().numpy() for o in seen[f"layer{i}.router"][2])
            logits, weights, experts = layer.mlp.route(x_mlp)
            np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=SIMPLE, rtol=SIMPLE, err_msg=f"{i} router")
            np.testing.assert_array_equal(np.asarray(experts), ref_experts, err_msg=f"layer {i} chosen experts")
            np.testing.assert_allclose(np.asarray(weights), ref_weights, atol=SIMPLE, rtol=SIMPLE, err_msg=f"{i} w")
            if kw["norm_topk_prob"]:
                np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)
            used |= set(np.asarray(experts).ravel().tolist())
        mixture = layer.mlp(x_mlp, routing)
        np.testing.assert_allclose(
            np.asarray(mixture),
            _np(seen[f"layer{i}.mlp"][2]),
            atol=COMPOSITE,
            rtol=COMPOSITE,
            err_msg=f"layer {i} mlp (expert mixture)",
        )
        attn_in = _input(seen[f"layer{i}.self_attn"])
        attn, _ = layer.self_attn(attn_in, positions, rope, routing, None)
        np.testing.assert_allclose(
            np.asarray(attn),
            _np(seen[f"layer{i}.self_attn"][2]),
            atol=COMPOSITE,
            rtol=COMPOSITE,
            err_msg=f"layer {i} attention",
        )
        x = _input(seen[f"layer{i}"])
        out, _ = layer(x, positions, rope, routing, None)
        np.testing.assert_allclose(
            np.asarray(out), _np(seen[f"layer{i}"][2]), atol=COMPOSITE, rtol=COMPOSITE, err_msg=f"layer {i}"
        )
    assert len(used) >= EXPERTS // 2, f"routing too concentrated to test the grouping: experts {sorted(used)}"
    ref = seen["logits"]
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(tokens), positions, routing)), ref, atol=COMPOSITE, rtol=COMPOSITE
    )


def _grad_of_squares(matmul, x, w, sizes):
    """d/dx sum(matmul(x, w, sizes) ** 2)."""
    return jax.grad(lambda x: jnp.sum(matmul(x, jnp.asarray(w), jnp.asarray(sizes)) ** 2))(x)


def test_blocked_grouped_matmul_equals_ragged_dot():
    """The CPU grouped matmul is exactly jax.lax.ragged_dot (including empty groups and rows in one group)."""
    rng = np.random.default_rng(0)
    for sizes in ([5, 0, 17, 3, 0, 40, 1, 2], [68, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 68]):
        sizes = np.array(sizes, np.int32)
        x = rng.normal(size=(int(sizes.sum()), 24)).astype(np.float32)
        w = rng.normal(size=(8, 24, 12)).astype(np.float32)
        want = jax.lax.ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
        got = _blocked_grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        dx = _grad_of_squares(_blocked_grouped_matmul, x, w, sizes)
        dx_ref = _grad_of_squares(jax.lax.ragged_dot, x, w, sizes)
        np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-5)
