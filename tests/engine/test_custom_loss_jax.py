"""Server-side custom losses in the engine: the SDK's traced graph (its own tracer and encoder), checked, run in JAX,
against the same traced graph run by torch, the SDK's client-side path (values, metrics and gradients at 1e-5), and
through Engine.forward_backward against the client-side protocol it replaces; hostile graphs are refused by name.

Tolerance 1e-5 (relative, of each tensor's scale): both sides compute in float32; torch and XLA order reductions
differently, so equal results differ in the last bits, far below 1e-5 for these sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_training import assert_grads_close, seqs
from tinkerflow.common import custom_loss_graph
from tinkerflow.workers.engine.training.custom_loss_jax import CompiledLoss
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, InputError, LoraConfig

torch = pytest.importorskip("torch")
F = torch.nn.functional
KEY, OWNER, SESSION = b"k" * 32, "owner", "sess-1"
TOL = 1e-5


def trace(fn, ranks):
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, ranks, SESSION)
    graph = encode_graph(handle).model_dump()
    checked = custom_loss_graph.check(
        handle.name, [{"name": i.name, "rank": i.rank} for i in handle.inputs], graph["nodes"]
    )
    return handle, checked


def torch_reference(handle, logprobs, inputs):
    lp = torch.tensor(logprobs, requires_grad=True)
    loss, metrics = handle.graph(lp, *(torch.tensor(x) for x in inputs))
    loss.backward()
    return float(loss.detach()), {k: float(v.detach()) for k, v in metrics.items()}, lp.grad.numpy()


# ------------------------------------------------------------------------------------------- losses for the test


def ppo_like(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": (advantages != 0).float().sum()}


def normalized_nll(logprobs, weights):
    """A mean over the datum's own length and std: shape-dependent, so padding would change it."""
    w = weights / (weights.sum() + 1e-6)
    z = (logprobs - logprobs.mean()) / (logprobs.std() + 1e-3)
    return -(w * logprobs).sum() + 0.01 * z.square().mean() + logprobs.shape[0] * 1e-3, {}


def kitchen_sink(logprobs, adv):
    a = F.softmax(logprobs, dim=-1) + F.log_softmax(logprobs, dim=-1) + logprobs.softmax(-1)
    b = F.logsigmoid(adv) + F.softplus(adv, beta=2.0) + F.relu(adv) + torch.sigmoid(adv) + torch.tanh(adv)
    c = torch.clamp(adv, -1, 1) + adv.clip(min=0) + torch.clamp_min(adv, 0) + adv.clamp_max(1.0) + adv.abs().sqrt()
    d = logprobs.std() + logprobs.var(dim=0, unbiased=False).sum() + torch.logsumexp(logprobs, dim=-1).sum()
    e = logprobs.reshape(-1).sum() + logprobs.view(logprobs.shape[0], -1).sum() + logprobs.unsqueeze(0).squeeze(0).sum()
    g = torch.stack([adv, adv], dim=0).sum() + torch.cat([adv, adv]).sum() + (adv**2).sum() + (1 - adv).sum()
    h = (
        torch.arange(adv.shape[0]).float().mul(adv).sum()
        + torch.ones_like(adv).sum()
        + torch.maximum(adv, 0 * adv).sum()
    )
    i = adv.masked_fill(adv > 0, 0.0).sum() + torch.where(adv > 0, adv, 0.0).sum() + adv.to(torch.float32).sum()
    j = logprobs.gather(-1, torch.zeros_like(logprobs, dtype=torch.long)).sum() + logprobs.max(dim=-1).values.sum()
    k = adv.max() + adv.min() + logprobs.amax(dim=-1).sum() + logprobs.cumsum(0).sum() + adv.size(0) + adv.numel()
    m = torch.nan_to_num(adv.log()).sum() + ((adv > 0) & (adv < 1)).float().sum() + adv.norm() + adv.detach().sum()
    n = logprobs[..., 1:].sum() + logprobs[-1].sum() + logprobs[:, None].sum() + logprobs.t().sum()
    loss = a.sum() + b.sum() + c.sum() + d + e + g + h + i + j + k + m + n
    return loss, {"custom/sink:sum": loss, "custom/argmax:mean": logprobs.argmax(dim=-1).float().mean()}


def reverse_kl(logprobs, weights):
    """tinker_cookbook.distillation.sdft.reverse_kl_custom_loss, one datum (its body, per datum)."""
    slot = weights > 0
    teacher = torch.where(slot, torch.log(weights.clamp(min=1e-30)), torch.zeros_like(weights))
    masked = torch.where(slot, logprobs, torch.full_like(logprobs, float("-inf")))
    log_p = torch.nan_to_num(torch.log_softmax(masked, dim=-1), nan=0.0, neginf=0.0)
    loss = (log_p.exp() * (log_p - teacher).detach() * slot.float()).sum()
    return loss, {"custom/rkl:sum": loss}


CASES = {
    "ppo_like": (ppo_like, {"logprobs": 1, "advantages": 1, "old": 1}),
    "normalized_nll": (normalized_nll, {"logprobs": 1, "weights": 1}),
    "kitchen_sink": (kitchen_sink, {"logprobs": 2, "adv": 1}),
    "reverse_kl": (reverse_kl, {"logprobs": 2, "weights": 2}),
}


def case_inputs(name, rng, n=7, k=3):
    lp = -np.abs(rng.normal(size=(n, k) if CASES[name][1]["logprobs"] == 2 else (n,))).astype(np.float32) - 0.1
    if name == "ppo_like":
        return lp, [rng.normal(size=n).astype(np.float32), (lp + 0.1 * rng.normal(size=n)).astype(np.float32)]
    if name == "normalized_nll":
        return lp, [rng.uniform(0, 1, size=n).astype(np.float32)]
    if name == "kitchen_sink":
        return lp, [rng.uniform(0.1, 2, size=n).astype(np.float32)]
    w = rng.uniform(0, 1, size=(n, k)).astype(np.float32)
    w[rng.uniform(size=(n, k)) < 0.3] = 0.0
    w[2] = 0.0  # a fully masked position
    return lp, [(w / np.maximum(w.sum(-1, keepdims=True), 1e-9)).astype(np.float32)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_jax_loss_equals_the_traced_torch_loss(name, rng):
    handle, checked = trace(*CASES[name])
    lp, inputs = case_inputs(name, rng)
    value, metrics, grad = CompiledLoss(checked)(lp, inputs)
    want_value, want_metrics, want_grad = torch_reference(handle, lp, inputs)
    assert value == pytest.approx(want_value, rel=TOL, abs=TOL)
    assert metrics.keys() == want_metrics.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(want_metrics[k], rel=TOL, abs=TOL), k
    np.testing.assert_allclose(grad, want_grad, rtol=TOL, atol=TOL * float(np.abs(want_grad).max()))


def _requests(slot, token_lists, inputs_per_datum, extra=None):
    data = []
    for toks, extra_inputs in zip(token_lists, inputs_per_datum, strict=True):
        toks = np.asarray(toks, np.int32)
        data.append(Datum(tokens=toks[:-1], inputs={"target_tokens": toks[1:], **extra_inputs}))
    return ForwardBackwardInput(slot=slot, data=data, loss_fn="custom", loss_fn_config=extra or {})


def test_engine_forward_backward_equals_the_client_side_protocol(engine, rng):
    """Slot 0: the loss server-side, one call. Slot 1 (same init): the SDK's client-side path, a forward pass,
    torch's loss and gradient, and cross_entropy with weights -dLoss/dlogprobs. Same loss, metrics, gradients."""
    handle, checked = trace(*CASES["ppo_like"])
    token = custom_loss_graph.loss_id(checked, SESSION, KEY, OWNER)
    for slot in (0, 1):
        engine.create_adapter(slot, LoraConfig(rank=4, seed=7))
    batch = seqs(rng, 3, 10)
    inputs = [
        {
            "advantages": rng.normal(size=9).astype(np.float32),
            "old": (-np.abs(rng.normal(size=9)) - 3).astype(np.float32),
        }
        for _ in batch
    ]
    server = engine.forward_backward([_requests(0, batch, inputs, {"loss_id": token})])[0]

    probe = [
        Datum(np.asarray(t[:-1], np.int32), {"target_tokens": np.asarray(t[1:], np.int32), "weights": np.zeros(9)})
        for t in batch
    ]
    fwd = engine.forward_backward([ForwardBackwardInput(1, probe, "cross_entropy", forward_only=True)])[0]
    total, sums, weighted = 0.0, {}, []
    for d, out, inp in zip(probe, fwd.outputs, inputs, strict=True):
        value, metrics, grad = torch_reference(handle, out["logprobs"], [inp["advantages"], inp["old"]])
        total += value
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        weighted.append(Datum(tokens=d.tokens, inputs={"target_tokens": d.inputs["target_tokens"], "weights": -grad}))
    engine.forward_backward([ForwardBackwardInput(1, weighted, "cross_entropy")])

    assert server.metrics["loss:sum"] == pytest.approx(total, rel=TOL)
    assert server.metrics["custom/tokens:sum"] == sums["custom/tokens:sum"]
    assert server.metrics["custom/ratio:mean"] == pytest.approx(sums["custom/ratio:mean"] / 3, rel=TOL)
    for a, b in zip(server.outputs, fwd.outputs, strict=True):  # the training pass's, as the client-side path's
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=TOL)
    assert_grads_close(engine.accumulated_grads(0), engine.accumulated_grads(1))


def test_a_bad_custom_request_fails_alone_and_accumulates_nothing(engine, rng):
    _, checked = trace(*CASES["normalized_nll"])
    token = custom_loss_graph.loss_id(checked, SESSION, KEY, OWNER)
    engine.create_adapter(0, LoraConfig(rank=2, seed=1))
    engine.create_adapter(1, LoraConfig(rank=2, seed=1))
    batch = seqs(rng, 2, 8)
    missing = _requests(0, batch, [{}, {}], {"loss_id": token})
    nan = _requests(1, batch, [{"weights": np.full(7, np.nan, np.float32)}] * 2, {"loss_id": token})
    good = _requests(1, batch, [{"weights": np.ones(7, np.float32)}] * 2, {"loss_id": token})
    out = engine.forward_backward([missing, nan, good])
    assert isinstance(out[0], InputError) and "loss_fn_inputs['weights']" in str(out[0])
    assert isinstance(out[1], InputError) and "the loss is nan" in str(out[1])
    assert out[2].metrics["loss:sum"] > 0
    assert all(not np.any(g) for g in engine.accumulated_grads(0).values())


# ------------------------------------------------------------------------------------------------ hostile graphs


def _graph(*nodes, inputs=(("logprobs", 1),)):
    return [{"name": n, "rank": r} for n, r in inputs], [
        {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}
        for op, name, target, args, kwargs in nodes
    ]


LP = ("placeholder", "logprobs", "logprobs", (), {})


def _out(ref):
    return ("output", "output", "output", ({"tuple": [{"ref": ref}, {"dict": {}}]},), {})


@pytest.mark.parametrize(
    "nodes, message",
    [
        ((LP, ("call_function", "s", "os.system", ("rm",), {}), _out("s")), "function 'os.system' is not allowed"),
        ((LP, ("call_method", "s", "exp_", ({"ref": "logprobs"},), {}), _out("s")), "method 'exp_' is not allowed"),
        ((LP, ("get_attr", "w", "weight", (), {}), _out("w")), "'get_attr' nodes are not allowed"),
        ((LP, ("call_module", "m", "linear", ({"ref": "logprobs"},), {}), _out("m")), "'call_module' nodes"),
        (
            (
                LP,
                ("call_function", "a", "operator.add", ({"ref": "b"}, 1), {}),
                ("call_function", "b", "operator.add", ({"ref": "a"}, 1), {}),
                _out("b"),
            ),
            "'b', which is not defined before",
        ),
        ((LP, ("call_function", "z", "torch.zeros", (2**40,), {}), _out("z")), "out of range"),
        (
            (LP, ("call_function", "z", "operator.add", ({"ref": "logprobs"}, list(range(2000))), {}), _out("z")),
            "more than 1024 literal",
        ),
        (
            (LP, ("call_function", "s", "operator.add", ({"ref": "logprobs"}, [[[[[[[[[[1]]]]]]]]]]), {}), _out("s")),
            "nested deeper than 8",
        ),
        ((LP, ("call_method", "s", "sum", ({"ref": "logprobs"},), {"out": None}), _out("s")), "unexpected keyword"),
        ((LP, ("call_function", "g", "getattr", ({"ref": "logprobs"}, "__class__"), {}), _out("g")), "not readable"),
        (
            (
                LP,
                ("call_method", "s", "sum", ({"ref": "logprobs"},), {}),
            ),
            "no output node",
        ),
    ],
)
def test_hostile_graphs_are_refused_naming_the_op(nodes, message):
    inputs, graph = _graph(*nodes)
    with pytest.raises(custom_loss_graph.CustomLossError, match=message):
        custom_loss_graph.check("hostile", inputs, graph)


def test_a_graph_past_its_datums_budget_is_refused_before_anything_is_allocated(rng):
    def outer(logprobs):
        big = logprobs[:, None] * logprobs[None, :]  # T x T
        return big.sum(), {}

    _, checked = trace(outer, {"logprobs": 1})
    value, _, _ = CompiledLoss(checked)(np.ones(100, np.float32), [])  # 10,000 elements: within 65,536
    assert value == 10_000
    with pytest.raises(custom_loss_graph.CustomLossError, match="over this datum's budget"):
        CompiledLoss(checked)(np.ones(5000, np.float32), [])  # 25M elements


def test_a_loss_id_is_the_owners_and_the_sessions_only():
    _, checked = trace(*CASES["ppo_like"])
    token = custom_loss_graph.loss_id(checked, SESSION, KEY, OWNER)
    assert custom_loss_graph.verify(token, SESSION, KEY, OWNER)
    assert not custom_loss_graph.verify(token, SESSION, KEY, "another-owner")
    assert not custom_loss_graph.verify(token, "sess-2", KEY, OWNER)
    assert not custom_loss_graph.verify(token.replace(".", "x.", 1), SESSION, KEY, OWNER)
    assert custom_loss_graph.from_source(custom_loss_graph.source_of(token)) == checked


def test_every_allowed_op_has_an_implementation_and_nothing_else_does():
    from tinkerflow.common.custom_loss_allowlist import SIGNATURES
    from tinkerflow.workers.engine.training.custom_loss_jax_ops import IMPLEMENTATIONS

    assert set(IMPLEMENTATIONS) == set(SIGNATURES)


def test_forward_only_custom_gives_the_loss_and_accumulates_nothing(engine, rng):
    """`forward(data, "custom", {"loss_id": ...})`: the loss and metrics of the same datums, no gradient."""
    _, checked = trace(*CASES["ppo_like"])
    token = custom_loss_graph.loss_id(checked, SESSION, KEY, OWNER)
    engine.create_adapter(0, LoraConfig(rank=2, seed=4))
    engine.create_adapter(1, LoraConfig(rank=2, seed=4))
    batch = seqs(rng, 2, 8)
    inputs = [{"advantages": np.ones(7, np.float32), "old": np.full(7, -4.0, np.float32)}] * 2
    train = _requests(0, batch, inputs, {"loss_id": token})
    probe = _requests(1, batch, inputs, {"loss_id": token})
    probe.forward_only = True
    a, b = engine.forward_backward([train, probe])
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=TOL)
    assert b.metrics["custom/ratio:mean"] == pytest.approx(a.metrics["custom/ratio:mean"], rel=TOL)
    assert any(np.any(g) for g in engine.accumulated_grads(0).values())
    assert not any(np.any(g) for g in engine.accumulated_grads(1).values())
