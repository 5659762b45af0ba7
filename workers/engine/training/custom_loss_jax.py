"""Server-side custom losses in the engine: a checked graph (tinkerflow.common.custom_loss_graph) as a JAX function, and
a forward_backward with loss_fn "custom" as two passes of the ordinary steps.

The loss is per datum, on the datum's exact shapes (a loss may take a mean or read `logprobs.shape`, so padding would
change it): the model's forward pass gives each datum's target logprobs; the loss and its gradient with respect to
them come from `jax.value_and_grad` of the interpreted graph, jitted per shape signature on the host CPU (tiny
programs, no accelerator memory); and the training pass is cross_entropy with weights = -dLoss/dlogprobs, whose
gradient is exactly the loss's (the SDK's client-side path does the same over HTTP). So the model runs its compiled
steps unchanged; a custom request costs one extra forward pass.

Bounds: every value the graph computes may hold at most `element_budget` elements (16x the datum's inputs, at least
65,536), checked while tracing, before anything is allocated; a loss or gradient that is not finite fails the request
(a user error naming the loss), which then changes no state.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tinkerflow.common.custom_loss_allowlist import SIGNATURES
from tinkerflow.common.custom_loss_graph import CheckedLoss, CustomLossError, Ref, from_source, source_of

from ..types import Datum, ForwardBackwardInput, InputError
from .custom_loss_jax_ops import IMPLEMENTATIONS, NEUTRAL

MIN_ELEMENT_BUDGET = 65_536
ELEMENT_BUDGET_FACTOR = 16
_CACHE_SIZE = 64  # compiled losses kept
_SHAPES_PER_LOSS = 256  # per-shape programs kept per loss


def element_budget(sizes: list[int]) -> int:
    return max(MIN_ELEMENT_BUDGET, ELEMENT_BUDGET_FACTOR * sum(sizes))


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, env), _resolve(value.stop, env), _resolve(value.step, env))
    return value


def _elements(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(_elements(v) for v in value)
    return int(np.prod(value.shape)) if hasattr(value, "shape") else 1


def interpret(loss: CheckedLoss, values: list[Any], budget: int) -> tuple[Any, dict[str, Any]]:
    """Run the graph on `values` (logprobs first, then the inputs in order): (loss, {metric: value})."""
    env: dict[str, Any] = {name: v for (name, _), v in zip(loss.inputs, values, strict=True)}
    for call in loss.calls:
        where = f"custom loss {loss.name!r}, node {call.name!r} ({call.op})"
        try:
            bound = SIGNATURES[call.op].bind(*_resolve(call.args, env), **_resolve(call.kwargs, env))
            kwargs = {k: v for k, v in bound.kwargs.items() if k not in NEUTRAL}
            out = IMPLEMENTATIONS[call.op](*bound.args, **kwargs)
        except CustomLossError:
            raise
        except Exception as e:  # the op refused its arguments (a shape, a dtype, a traced size)
            raise CustomLossError(f"{where}: {type(e).__name__}: {str(e)[:300]}") from None
        if _elements(out) > budget:
            raise CustomLossError(
                f"{where}: makes {_elements(out):,} elements, over this datum's budget of {budget:,} "
                f"({ELEMENT_BUDGET_FACTOR}x its inputs, at least {MIN_ELEMENT_BUDGET:,})"
            )
        env[call.name] = out
    return env[loss.loss.name], {k: env[ref.name] for k, ref in loss.metrics}


class CompiledLoss:
    """One checked loss: its value, metrics and gradient per datum, jitted per shape signature on the CPU."""

    def __init__(self, loss: CheckedLoss):
        self.loss = loss
        self._cpu = jax.devices("cpu")[0]
        self._fns: OrderedDict[tuple, Any] = OrderedDict()

    def _fn(self, shapes: tuple, budget: int):
        key = (shapes, budget)
        if key in self._fns:
            self._fns.move_to_end(key)
        else:
            while len(self._fns) >= _SHAPES_PER_LOSS:
                self._fns.popitem(last=False)
            loss = self.loss

            def value(logprobs, *inputs):
                out, metrics = interpret(loss, [logprobs, *inputs], budget)
                if not (hasattr(out, "shape") and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
                    got = f"shape {tuple(getattr(out, 'shape', ()))}, dtype {getattr(out, 'dtype', type(out))}"
                    raise CustomLossError(f"custom loss {loss.name!r} must return a scalar float loss, got {got}")
                for k, m in metrics.items():
                    if getattr(m, "shape", ()) != ():
                        raise CustomLossError(f"custom loss {loss.name!r}: metric {k!r} must be a scalar")
                return out, {k: jnp.asarray(m, jnp.float32) for k, m in metrics.items()}

            self._fns[key] = jax.jit(jax.value_and_grad(value, has_aux=True))
        return self._fns[key]

    def __call__(self, logprobs: np.ndarray, inputs: list[np.ndarray]) -> tuple[float, dict[str, float], np.ndarray]:
        """(loss, metrics, dLoss/dlogprobs) of one datum."""
        shapes = tuple((a.shape, str(a.dtype)) for a in (logprobs, *inputs))
        fn = self._fn(shapes, element_budget([a.size for a in (logprobs, *inputs)]))
        with jax.default_device(self._cpu):
            (value, metrics), grad = fn(logprobs, *inputs)
        return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad, np.float32)


_compiled: OrderedDict[str, CompiledLoss] = OrderedDict()


def compiled(loss_id: Any) -> CompiledLoss:
    """The compiled loss behind a loss_id (the API verified its signature and its tenant before admitting the op)."""
    if not isinstance(loss_id, str):
        raise InputError("loss_fn 'custom' needs loss_fn_config['loss_id'] from ServiceClient.create_custom_loss")
    source = source_of(loss_id)
    key = hashlib.sha256(source.encode()).hexdigest()
    if key not in _compiled:
        _compiled[key] = CompiledLoss(from_source(source))
        while len(_compiled) > _CACHE_SIZE:
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return _compiled[key]


@dataclass
class Prepared:
    """A custom request ready to run: its loss, each datum's loss inputs, and the forward-only probe of its logprobs."""

    loss: CompiledLoss
    inputs: list[list[np.ndarray]]
    probe: ForwardBackwardInput


def prepare(req: ForwardBackwardInput) -> Prepared:
    """Check a custom request's datums against its loss's declared inputs; InputError naming the datum and input."""
    extra = sorted(set(req.loss_fn_config) - {"loss_id"})
    if extra:
        raise InputError(f"loss_fn 'custom' takes loss_fn_config {{'loss_id'}} only, got also {extra}")
    loss = compiled(req.loss_fn_config.get("loss_id"))
    (_, lp_rank), *declared = loss.loss.inputs
    if not req.data:
        raise InputError("forward_backward needs at least one datum")
    inputs, probes = [], []
    for i, d in enumerate(req.data):
        targets = np.asarray(d.inputs.get("target_tokens")) if "target_tokens" in d.inputs else None
        if targets is None or targets.ndim != lp_rank:
            raise InputError(
                f"datum {i}: loss {loss.loss.name!r} takes logprobs of rank {lp_rank}, so it needs "
                f"target_tokens of rank {lp_rank}"
            )
        row = []
        for name, rank in declared:
            if name not in d.inputs:
                raise InputError(f"datum {i}: loss {loss.loss.name!r} reads loss_fn_inputs[{name!r}], which it lacks")
            value = np.asarray(d.inputs[name])
            if rank == 0 and value.size == 1:  # the wire cannot tell shape [] from [1]: the declared rank decides
                value = value.reshape(())
            if value.ndim != rank:
                raise InputError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has rank {value.ndim}, loss "
                    f"{loss.loss.name!r} declared rank {rank}"
                )
            row.append(value.astype(np.float32) if value.dtype.kind == "f" else value.astype(np.int32))
        inputs.append(row)
        probes.append(
            Datum(
                tokens=d.tokens,
                inputs={"target_tokens": targets, "weights": np.zeros(targets.shape, np.float32)},
                images=d.images,
            )
        )
    probe = ForwardBackwardInput(slot=req.slot, data=probes, loss_fn="cross_entropy", forward_only=True)
    return Prepared(loss, inputs, probe)


def weighted(prep: Prepared, req: ForwardBackwardInput, logprobs: list[np.ndarray]):
    """Each datum's loss and metrics, and the cross_entropy request whose gradient is the loss's (weights =
    -dLoss/dlogprobs); InputError when a loss or gradient is not finite."""
    name = prep.loss.loss.name
    total, sums, data = 0.0, {}, []
    for i, (lp, row, probe) in enumerate(zip(logprobs, prep.inputs, prep.probe.data, strict=True)):
        value, metrics, grad = prep.loss(np.asarray(lp, np.float32), row)
        if not math.isfinite(value):
            raise InputError(f"custom loss {name!r}: datum {i}: the loss is {value}")
        if not np.all(np.isfinite(grad)):
            raise InputError(
                f"custom loss {name!r}: datum {i}: the gradient is not finite at position "
                f"{int(np.flatnonzero(~np.isfinite(grad.reshape(-1)))[0])}"
            )
        total += value
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        data.append(
            Datum(
                tokens=probe.tokens,
                inputs={"target_tokens": probe.inputs["target_tokens"], "weights": -grad},
                images=probe.images,
            )
        )
    n = len(logprobs)
    metrics = {k: v / n if k.endswith(":mean") else v for k, v in sums.items()}
    train = ForwardBackwardInput(slot=req.slot, data=data, loss_fn="cross_entropy", forward_only=req.forward_only)
    return total, metrics, train
