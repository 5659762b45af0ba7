"""LoRA on Qwen3.5 and Qwen3.5-MoE (families/qwen3_5) with non-zero A and B on every linear: logits and the LoRA
parameters' gradients against transformers 5.23 at float32.

* Dense: PEFT wraps every linear transformers has (the five Gated DeltaNet projections, q/k/v/o, the MLP, lm_head)
  with our A and B; logits and every A/B gradient compared.
* MoE: PEFT reaches transformers 5's fused expert parameters only through `target_parameters` with a layout of its
  own (test_moe_lora.py), so the reference here is transformers with the adapter merged into its weights, W + s A B
  on every linear and every expert's projections. LoRA computes exactly that function of the merged weight, so our
  A/B gradients must equal the chain rule through it: dA = s dW B^T, dB = s A^T dW, with dW torch's gradient of the
  merged weight.

The loss is the mean next-token cross entropy over ragged rows. Tolerances (measured values in brackets): logits as
test_qwen3_5_layers.py (relative L2 1e-5 over all, 1e-4 per token); each gradient tensor within 1e-4 relative L2
[up to 4e-5, most below 1e-5], the composite tolerance, not 1e-5: a LoRA gradient here is a backward pass through
the whole model, and transformers' own float32 gradients differ from its float64 ones by up to 2.2e-5 relative L2
(ours: 2.1e-5). The gated delta rule's own gradients hold at 1e-5 elementwise (test_qwen3_5_gated_delta.py). The
slot no row routes to and the columns beyond the adapter's rank get exactly zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qwen3_5_reference import VOCAB, hf_model, logits_close, lora_modules, our_model, positions, text_config

from tinkerflow.workers.engine.model.attention import Segments
from tinkerflow.workers.engine.model.families.qwen3_5.model import LORA_KINDS
from tinkerflow.workers.engine.model.lora import LoraRouting, module_kind
from tinkerflow.workers.engine.model.moe import ExpertLinear
from tinkerflow.workers.engine.model.remat import Remat

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")

GRAD_L2 = 1e-4
RANK, ALPHA, SLOT = 4, 8, 1
SCALE = ALPHA / RANK
T, LENGTHS = 75, (75, 58)
TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS += ["gate_proj", "up_proj", "down_proj", "lm_head"]


def _fill_adapters(ours, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random A and B (B non-zero) in SLOT's first RANK columns of every LoRA module, other values in slot 0;
    returns SLOT's (A [.., in, RANK], B [.., RANK, out]) by module path."""
    rng = np.random.default_rng(seed)
    values = {}
    for path, module in lora_modules(ours).items():
        a, b = module.lora_a[...], module.lora_b[...]
        fan_in = a.shape[-2]
        new_a = rng.normal(0.0, 1.0 / np.sqrt(fan_in), a.shape).astype(np.float32)
        new_b = rng.normal(0.0, 0.1, b.shape).astype(np.float32)
        new_a[SLOT, ..., RANK:] = 0.0
        new_b[SLOT, ..., RANK:, :] = 0.0
        module.lora_a[...], module.lora_b[...] = jnp.asarray(new_a), jnp.asarray(new_b)
        values[path] = (new_a[SLOT, ..., :RANK], new_b[SLOT, ..., :RANK, :])
    return values


def _batch(seed: int):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=(len(LENGTHS), T + 1)).astype(np.int64)
    mask = (np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.float32)
    return tokens[:, :-1], tokens[:, 1:], mask


def _torch_loss(logits, targets: np.ndarray, mask: np.ndarray):
    lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(targets)[..., None])[..., 0]
    return -(lp * torch.from_numpy(mask)).sum() / float(mask.sum())


def _ours_logits_and_grads(ours, tokens, targets, mask):
    b = tokens.shape[0]
    routing = LoraRouting(adapter=jnp.full((b,), SLOT, jnp.int32), scale=jnp.full((b,), SCALE, jnp.float32))
    seg = Segments.right_padded(jnp.asarray(LENGTHS), T)
    graphdef, lora, rest = nnx.split(ours, nnx.LoRAParam, ...)

    def loss(lora):
        logits = nnx.merge(graphdef, lora, rest)(jnp.asarray(tokens, jnp.int32), positions(T, b), routing, seg)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(targets)[..., None], -1)[..., 0]
        return -(lp * mask).sum() / mask.sum(), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(lora)
    by_path = {".".join(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    return np.asarray(logits), by_path


def _grad_close(actual: np.ndarray, desired: np.ndarray, msg: str) -> None:
    err = np.linalg.norm(actual - desired) / np.linalg.norm(desired)
    assert np.abs(desired).max() > 0, f"{msg}: the reference gradient is zero, the comparison would be empty"
    assert err <= GRAD_L2, f"{msg}: relative L2 error {err:.2e}"


def _assert_unused_grads_zero(grads: dict[str, np.ndarray]) -> None:
    for path, g in grads.items():
        assert np.all(g[1 - SLOT] == 0), f"{path}: the slot no row routes to has a gradient"
        beyond = g[SLOT, ..., RANK:] if path.endswith("lora_a") else g[SLOT, ..., RANK:, :]
        assert np.all(beyond == 0), f"{path}: columns beyond the adapter's rank have a gradient"


def test_every_lora_module_has_a_train_group():
    """lora.module_kind plus LORA_KINDS name the group (attn / mlp / unembed) of every LoRA leaf of both variants."""
    for moe in (False, True):
        ours = our_model(hf_model(text_config(moe=moe)))
        for path, _ in nnx.to_flat_state(nnx.state(ours, nnx.LoRAParam)):
            names = [str(p) for p in path]
            added = [LORA_KINDS[n] for n in reversed(names) if n in LORA_KINDS]
            assert added or module_kind(path), path


def test_dense_lora_matches_peft():
    import peft

    hf = hf_model(text_config(), seed=3)
    ours = our_model(hf)
    adapters = _fill_adapters(ours, seed=4)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    wrapped = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                path = "layers." + name.split(".layers.", 1)[1] if ".layers." in name else "lm_head"
                a, b = adapters[path]
                module.lora_A["default"].weight.copy_(torch.from_numpy(a.T))
                module.lora_B["default"].weight.copy_(torch.from_numpy(b.T))
                wrapped[path] = module
    assert wrapped.keys() == adapters.keys(), "PEFT and ours hold LoRA on the same linears"

    tokens, targets, mask = _batch(seed=5)
    ref_logits = model(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask).long()).logits
    _torch_loss(ref_logits, targets, mask).backward()
    logits, grads = _ours_logits_and_grads(ours, tokens, targets, mask)
    for row, n in enumerate(LENGTHS):
        logits_close(logits[row, :n], ref_logits[row, :n].detach().numpy(), f"row {row}")
    for path, module in wrapped.items():
        _grad_close(grads[f"{path}.lora_a"][SLOT, :, :RANK], module.lora_A["default"].weight.grad.numpy().T, path)
        _grad_close(grads[f"{path}.lora_b"][SLOT, :RANK], module.lora_B["default"].weight.grad.numpy().T, path)
    _assert_unused_grads_zero(grads)


def _merge_into(hf, ours, adapters) -> dict[str, tuple[str, slice | None]]:
    """Add SCALE * A @ B to transformers' weight of every LoRA module; returns, per module, the transformers
    parameter it merged into and the part of a fused expert gate_up it is (None: the whole parameter)."""
    params = dict(hf.named_parameters())
    modules = lora_modules(ours)
    where: dict[str, tuple[str, slice | None]] = {}
    with torch.no_grad():
        for path, (a, b) in adapters.items():
            delta = torch.from_numpy(np.swapaxes(SCALE * np.matmul(a, b), -1, -2))  # transformers' [.., out, in]
            part = None
            if isinstance(modules[path], ExpertLinear):  # experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
                parent, proj = path.rsplit(".", 1)
                name = f"model.{parent}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
                half = delta.shape[-2]
                part = {"gate_proj": slice(0, half), "up_proj": slice(half, 2 * half)}.get(proj)
            else:
                name = "lm_head.weight" if path == "lm_head" else f"model.{path}.weight"
            target = params[name] if part is None else params[name][:, part]
            target += delta  # in place (a slice is a view)
            where[path] = (name, part)
    return where


def test_moe_lora_matches_merged_weights():
    hf = hf_model(text_config(moe=True), seed=6)
    ours = our_model(hf)
    adapters = _fill_adapters(ours, seed=7)
    where = _merge_into(hf, ours, adapters)
    assert any(".experts." in p for p in where) and any("shared_expert_gate" in p for p in where)

    tokens, targets, mask = _batch(seed=8)
    ref_logits = hf(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask).long()).logits
    _torch_loss(ref_logits, targets, mask).backward()
    logits, grads = _ours_logits_and_grads(ours, tokens, targets, mask)
    for row, n in enumerate(LENGTHS):
        logits_close(logits[row, :n], ref_logits[row, :n].detach().numpy(), f"row {row}")
    params = dict(hf.named_parameters())
    for path, (a, b) in adapters.items():
        name, part = where[path]
        grad = params[name].grad
        assert grad is not None, name
        dw = np.swapaxes((grad if part is None else grad[:, part]).numpy(), -1, -2)  # ours [.., in, out]
        _grad_close(grads[f"{path}.lora_a"][SLOT, ..., :RANK], SCALE * np.matmul(dw, np.swapaxes(b, -1, -2)), path)
        _grad_close(grads[f"{path}.lora_b"][SLOT, ..., :RANK, :], SCALE * np.matmul(np.swapaxes(a, -1, -2), dw), path)
    _assert_unused_grads_zero(grads)


REMAT_TOL = 1e-6  # recomputation runs the same float32 operations again; only fusion may reorder a sum


@pytest.mark.parametrize(
    "level,moe",
    [
        (Remat.DOTS, False),
        # FULL and the routed experts' DOTS run under -m slow (tests/engine/test_remat_levels.py checks every level
        # on the dense families in the default run).
        pytest.param(Remat.FULL, False, marks=pytest.mark.slow),
        pytest.param(Remat.DOTS, True, marks=pytest.mark.slow),
    ],
    ids=["dots", "full", "dots_moe"],
)
def test_gradient_checkpointing_gives_the_same_gradients(level, moe):
    """`remat` (one `checkpointed` call per layer, shared with the dense families) keeps each layer's input (and at
    DOTS its matmul outputs) and recomputes the rest of the layer in the backward pass: the same loss and LoRA
    gradients as keeping every activation, at either level (model/remat.py); with routed experts too (DOTS keeps
    their grouped matmuls' outputs by name, moe.py)."""
    ours = our_model(hf_model(text_config(moe=moe), seed=9))
    _fill_adapters(ours, seed=10)
    tokens, targets, mask = _batch(seed=11)
    logits, grads = _ours_logits_and_grads(ours, tokens, targets, mask)
    ours.remat = level
    remat_logits, remat_grads = _ours_logits_and_grads(ours, tokens, targets, mask)
    np.testing.assert_allclose(remat_logits, logits, rtol=0, atol=REMAT_TOL)
    for path, g in grads.items():
        err = np.linalg.norm(remat_grads[path] - g) / max(np.linalg.norm(g), 1e-30)
        assert err <= REMAT_TOL, f"{path}: relative L2 {err:.2e} between the checkpointed and the kept backward pass"
