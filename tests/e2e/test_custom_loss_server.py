"""Server-side custom losses through the unmodified SDK: /client/config turns `custom_loss_server_side` on, so
`ServiceClient.create_custom_loss` uploads the traced loss and `forward_backward_custom(data, handle)` runs it in the
engine in one call. Each loss is checked against the client-side path on a twin run (same seed): the same traced
loss run by the SDK itself (the handle without its loss_id), or the cookbook's own batch-level loss function.

Equal gradients are read off the weights: one AdamW step with lr = eps = 1e4 moves each LoRA B entry (A has no
gradient at the first step, B starting at zero) by g / (1 + |g| / 1e4), a function of g alone, and
save_weights_for_sampler writes B. Tolerance 1e-5 of each tensor's scale (both sides float32; torch and XLA order
their sums differently).
"""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import OTHER_API_KEY
from tests.e2e.test_tenancy_routes import _poll

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")
TOL = 1e-5
LINEAR_ADAM = types.AdamParams(learning_rate=1e4, eps=1e4)  # moves w by g / (1 + |g| / 1e4): see the module doc


def ppo_like(logprobs, advantages, old):
    ratio = torch.exp(logprobs - old)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/tokens:sum": (advantages != 0).float().sum()}


def normalized_nll(logprobs, weights):
    w = weights / (weights.sum() + 1e-6)
    return -(w * logprobs).sum() + 0.01 * ((logprobs - logprobs.mean()) / (logprobs.std() + 1e-3)).square().mean(), {}


def reverse_kl(logprobs, weights):
    """tinker_cookbook.distillation.sdft.reverse_kl_custom_loss's body, for one datum."""
    slot = weights > 0
    teacher = torch.where(slot, torch.log(weights.clamp(min=1e-30)), torch.zeros_like(weights))
    masked = torch.where(slot, logprobs, torch.full_like(logprobs, float("-inf")))
    log_p = torch.nan_to_num(torch.log_softmax(masked, dim=-1), nan=0.0, neginf=0.0)
    loss = (log_p.exp() * (log_p - teacher).detach() * slot.float()).sum()
    return loss, {"custom/rkl:sum": loss}


def brier(logprobs, weights, scale):
    """tinker_cookbook.recipes.decisions: probability_loss(brier_score_loss) for one datum; the batch mean becomes
    a sum of per-datum losses scaled by 1 / batch size (the `scale` input)."""
    from tinker_cookbook.recipes.decisions.forecasting import brier_score_loss

    probs = torch.softmax(logprobs[-1].float(), dim=-1)
    return brier_score_loss(probs, weights[-1].float()) * scale, {}


def _datum(tokens, k=None, **inputs):
    targets = [t + 1 for t in tokens] if k is None else [[t + j + 1 for j in range(k)] for t in tokens]
    fields = {"target_tokens": np.asarray(targets, np.int64), **inputs}
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={name: types.TensorData.from_numpy(np.asarray(v)) for name, v in fields.items()},
    )


def _b_matrices(stack, training, name) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    path = training.save_weights_for_sampler(name).result(timeout=300).path
    run, _, rest = path.removeprefix("tinker://").partition("/")
    tensors = load_file(stack.state_dir / "checkpoints" / run / rest / "adapter_model.safetensors")
    return {k: v for k, v in tensors.items() if ".lora_B." in k}


def _parity(stack, base_model, fn, ranks, data, client_side=None, *, loss_scale=1.0):
    """`fn` server-side vs client-side on twin runs of one session (a handle serves only its own session's clients):
    `client_side` is a cookbook callable, or None for the SDK running the same traced handle itself."""
    with tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key) as twins:
        handle = twins.create_custom_loss(fn, ranks).result(timeout=300)
        assert handle.loss_id is not None
        same_handle = client_side is None
        client_side = dataclasses.replace(handle, loss_id=None) if same_handle else client_side
        a, b = (
            twins.create_lora_training_client(base_model=base_model, rank=4, seed=11).result(timeout=300)
            for _ in range(2)
        )
        server = a.forward_backward_custom(data, handle).result(timeout=300)
        client = b.forward_backward_custom(data, client_side).result(timeout=300)
        assert server.metrics["loss:sum"] == pytest.approx(client.metrics["loss:sum"] * loss_scale, rel=TOL, abs=TOL)
        mine = {k for k in server.metrics if k.startswith("custom/")}
        if same_handle:  # the cookbook's functions name their metrics their own way
            assert mine == {k for k in client.metrics if k.startswith("custom/")}
        for key in mine & set(client.metrics):
            assert server.metrics[key] == pytest.approx(client.metrics[key], rel=TOL, abs=TOL), key
        for s, c in zip(server.loss_fn_outputs, client.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(s["logprobs"].to_numpy(), c["logprobs"].to_numpy(), rtol=TOL)
        for run in (a, b):
            run.optim_step(LINEAR_ADAM).result(timeout=300)
        got, want = _b_matrices(stack, a, "server"), _b_matrices(stack, b, "client")
        assert got.keys() == want.keys() and got
        for k in want:
            scale = float(np.abs(want[k]).max()) * loss_scale
            np.testing.assert_allclose(got[k], want[k] * loss_scale, rtol=0, atol=TOL * scale + 1e-12, err_msg=k)
        return server


def test_the_server_turns_custom_losses_on(service_client):
    assert service_client.holder.get_client_config().custom_loss_server_side


@pytest.mark.parametrize("name", ["ppo_like", "normalized_nll"])
def test_a_loss_written_for_the_test_runs_server_side_as_it_runs_client_side(stack, base_model, name):
    rng = np.random.default_rng(5)
    fn, ranks = {
        "ppo_like": (ppo_like, {"logprobs": 1, "advantages": 1, "old": 1}),
        "normalized_nll": (normalized_nll, {"logprobs": 1, "weights": 1}),
    }[name]
    data = []
    for n in (5, 9, 7):
        tokens = [int(t) for t in rng.integers(1, 200, size=n)]
        extra = (
            {"advantages": rng.normal(size=n).astype(np.float32), "old": np.full(n, -5.0, np.float32)}
            if name == "ppo_like"
            else {"weights": rng.uniform(size=n).astype(np.float32)}
        )
        data.append(_datum(tokens, **extra))
    # The SDK runs a handle without a loss_id client-side: the very same traced graph, in torch.
    out = _parity(stack, base_model, fn, ranks, data)
    if name == "ppo_like":
        assert out.metrics["custom/tokens:sum"] == 21.0


def test_the_cookbooks_custom_losses_run_server_side(stack, base_model):
    """sdft's reverse-KL loss and the decisions recipe's Brier loss, per datum server-side, against the cookbook's own
    batch-level functions run client-side by the SDK."""
    from tinker_cookbook.distillation.sdft import reverse_kl_custom_loss
    from tinker_cookbook.recipes.decisions.forecasting import brier_score_loss
    from tinker_cookbook.recipes.decisions.train import probability_loss

    rng = np.random.default_rng(6)
    data = []
    for n in (6, 4):
        q = rng.uniform(size=(n, 3)).astype(np.float32) * (rng.uniform(size=(n, 3)) > 0.3)
        q[0] = 0.0  # a masked position
        q = q / np.maximum(q.sum(-1, keepdims=True), 1e-9)
        data.append(_datum([int(t) for t in rng.integers(1, 200, size=n)], k=3, weights=q))
    _parity(stack, base_model, reverse_kl, {"logprobs": 2, "weights": 2}, data, reverse_kl_custom_loss)

    data = []
    for n in (5, 8, 3):
        target = np.zeros((n, 2), np.float32)
        target[-1] = (0.7, 0.3)
        data.append(
            _datum([int(t) for t in rng.integers(1, 200, size=n)], k=2, weights=target, scale=np.float32(1 / 3))
        )
    ranks = {"logprobs": 2, "weights": 2, "scale": 0}
    _parity(stack, base_model, brier, ranks, data, probability_loss(brier_score_loss))


def test_what_the_server_cannot_run_is_refused_by_name(stack, service_client):
    """A torch function outside the allow-list, through the SDK; and graphs the SDK would never send (a cycle, a huge
    constant, deep nesting, an unknown op), raw: each a failed future naming the node and the op."""

    def noisy(logprobs):
        return (logprobs + torch.randn_like(logprobs)).sum(), {}

    with pytest.raises(tinker.RequestFailedError, match=r"function 'torch.randn_like' is not allowed"):
        service_client.create_custom_loss(noisy, {"logprobs": 1}).result(timeout=300)

    rest = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": stack.api_key}, timeout=120)
    lp = {"op": "placeholder", "name": "logprobs", "target": "logprobs"}

    def call(name, target, *args, op="call_function"):
        return {"op": op, "name": name, "target": target, "args": list(args)}

    def out(ref):
        return {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": ref}, {"dict": {}}]}]}

    cases = {
        "cycle": (
            [lp, call("a", "operator.add", {"ref": "b"}, 1), call("b", "operator.add", {"ref": "a"}, 1), out("b")],
            "refers to 'b', which is not defined before it",
        ),
        "huge constant": ([lp, call("z", "torch.zeros", 10**12), out("z")], "out of range"),
        "deep nesting": (
            [lp, call("s", "operator.add", {"ref": "logprobs"}, [[[[[[[[[[[1]]]]]]]]]]]), out("s")],
            "nested deeper than 8",
        ),
        "unknown op": ([lp, call("s", "subprocess.run", "ls"), out("s")], "function 'subprocess.run' is not allowed"),
        "in place": (
            [lp, call("s", "exp_", {"ref": "logprobs"}, op="call_method"), out("s")],
            "method 'exp_' is not allowed",
        ),
    }
    session = service_client.holder.get_session_id()
    for seq, (case, (nodes, message)) in enumerate(cases.items(), start=100):
        body = {
            "session_id": session,
            "custom_loss_seq_id": seq,
            "name": case,
            "type": "create_custom_loss",
            "inputs": [{"name": "logprobs", "rank": 1}],
            "graph": {"format": 1, "nodes": nodes},
        }
        r = rest.post("/api/v1/create_custom_loss", json=body)
        assert r.status_code == 200, r.text
        outcome = _poll(rest, r.json()["request_id"])
        assert outcome["category"] == "user" and message in outcome["error"], (case, outcome)


def test_one_tenants_loss_is_invisible_to_another(stack, base_model, service_client, training_client):
    handle = service_client.create_custom_loss(normalized_nll, {"logprobs": 1, "weights": 1}).result(timeout=300)
    datum = _datum([3, 4, 5, 6], weights=np.ones(4, np.float32))
    config = {"loss_id": handle.loss_id}
    # Its own session: fine, as forward_backward_custom sends it.
    assert training_client.forward_backward([datum], "custom", config).result(timeout=300).metrics["loss:sum"] > 0
    bob = tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER_API_KEY)
    bobs = bob.create_lora_training_client(base_model=base_model, rank=2).result(timeout=300)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key) as mine:  # same tenant, other session
        elsewhere = mine.create_lora_training_client(base_model=base_model, rank=2).result(timeout=300)
        for run in (bobs, elsewhere):
            with pytest.raises(tinker.RequestFailedError, match="unknown loss_id") as info:
                run.forward_backward([datum], "custom", config).result(timeout=300)
            assert str(info.value.category).endswith("user")
            run.forward_backward([datum], "cross_entropy").result(timeout=300)  # and the run goes on
