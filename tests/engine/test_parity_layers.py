"""Per-layer parity with transformers: every module of ours fed exactly the input its HF twin saw.

Tolerances (never loosened): 1e-5 for simple modules (embedding, RMSNorm, MLP), 1e-4 for composite ones
(attention with rope and q/k norm, whole decoder layers).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tinkerflow.workers.engine.model.loader import load_model
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.rope import rope_tables

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")

SIMPLE, COMPOSITE = 1e-5, 1e-4


def _capture(hf, tokens: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(input hidden states, output) of each interesting HF module, recorded by forward hooks."""
    seen: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
            out = output[0] if isinstance(output, tuple) else output
            seen[name] = (x.detach().numpy(), out.detach().numpy())

        return record

    hf.model.embed_tokens.register_forward_hook(hook("embed"), with_kwargs=True)
    hf.model.norm.register_forward_hook(hook("norm"), with_kwargs=True)
    for i, layer in enumerate(hf.model.layers):
        layer.register_forward_hook(hook(f"layer{i}"), with_kwargs=True)
        layer.input_layernorm.register_forward_hook(hook(f"layer{i}.input_layernorm"), with_kwargs=True)
        layer.self_attn.register_forward_hook(hook(f"layer{i}.self_attn"), with_kwargs=True)
        layer.mlp.register_forward_hook(hook(f"layer{i}.mlp"), with_kwargs=True)
    with torch.no_grad():
        hf(torch.from_numpy(tokens).long())
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_every_layer_matches_transformers(tmp_path, make_checkpoint, arch):
    from transformers import AutoModelForCausalLM

    directory = make_checkpoint(tmp_path / arch, arch=arch, tie=False, seed=5)
    tokens = np.random.default_rng(1).integers(0, 300, size=(2, 12)).astype(np.int32)
    seen = _capture(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), tokens)

    loaded = load_model(str(directory), max_adapters=1, max_rank=1, progress=False)
    model = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
    b, t = tokens.shape
    routing = LoraRouting(adapter=jnp.zeros((b,), jnp.int32), scale=jnp.zeros((b,), jnp.float32))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    rope = rope_tables(model.config, positions)

    def check(name, ours, tol):
        np.testing.assert_allclose(np.asarray(ours), seen[name][1], atol=tol, rtol=tol, err_msg=name)

    check("embed", model.embed_tokens(jnp.asarray(tokens)), SIMPLE)
    for i, layer in enumerate(model.layers):
        x = jnp.asarray(seen[f"layer{i}"][0])
        check(f"layer{i}.input_layernorm", layer.input_layernorm(x), SIMPLE)
        check(f"layer{i}.mlp", layer.mlp(jnp.asarray(seen[f"layer{i}.mlp"][0]), routing), SIMPLE)
        attn, _ = layer.self_attn(jnp.asarray(seen[f"layer{i}.self_attn"][0]), positions, rope, routing, None)
        check(f"layer{i}.self_attn", attn, COMPOSITE)
        out, _ = layer(x, positions, rope, routing, None)
        check(f"layer{i}", out, COMPOSITE)
    check("norm", model.norm(jnp.asarray(seen["norm"][0])), SIMPLE)
