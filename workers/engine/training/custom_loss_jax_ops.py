"""The custom-loss operations in JAX, one function per op of the allow-list (tinkerflow.common.custom_loss_allowlist),
each with torch's signature and torch's semantics where they differ from numpy's (squeeze of a dim that is not 1, max
with a dim returning values and indices, std's correction, softplus's threshold, integer arithmetic on shapes in
Python).

Floating dtypes compute in float32 and integer ones in int32 (JAX without x64). Arguments that cannot change a value
(device, layout, memory_format, requires_grad, ...: NEUTRAL) are dropped by the interpreter before the call."""

from __future__ import annotations

import operator
from collections import namedtuple
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.special

from tinkerflow.common.custom_loss_graph import Token

MaxResult = namedtuple("MaxResult", "values indices")  # torch.return_types.max / min with a dim

_FLOAT = {"float32", "float64", "float16", "bfloat16"}
_INT = {"int64", "int32", "int16", "int8", "uint8"}


def dtype_of(token: Any) -> Any:
    if token is None:
        return None
    if not isinstance(token, Token) or token.kind != "dtype":
        raise TypeError(f"expected a dtype, got {token!r}")
    return jnp.float32 if token.value in _FLOAT else jnp.int32 if token.value in _INT else jnp.bool_


def torch_dtype(x: Any) -> Token:
    kind = jnp.asarray(x).dtype
    name = "bool" if kind == jnp.bool_ else "float32" if jnp.issubdtype(kind, jnp.floating) else "int64"
    return Token("dtype", name)


def _py(*xs: Any) -> bool:
    return all(isinstance(x, (int, float, bool)) for x in xs)


def _axes(dim: Any) -> Any:
    return tuple(dim) if isinstance(dim, (list, tuple)) else dim


def _cast(x: Any, dtype: Any) -> Any:
    return x if dtype is None else jnp.asarray(x).astype(dtype_of(dtype))


def _binary(py_op, jnp_op):
    def op(input, other):
        return py_op(input, other) if _py(input, other) else jnp_op(input, other)

    return op


def _unary(fn):
    return lambda input: fn(input)


def _reduce(fn):
    def op(input, dim=None, keepdim=False, *, dtype=None):
        return fn(_cast(input, dtype), axis=_axes(dim), keepdims=keepdim)

    return op


def _extreme(fn, arg):
    def op(input, dim=None, keepdim=False):
        if dim is None:
            return fn(input)
        if not isinstance(dim, int):  # torch.max(a, b): elementwise
            return jnp.maximum(input, dim) if fn is jnp.max else jnp.minimum(input, dim)
        return MaxResult(fn(input, axis=dim, keepdims=keepdim), arg(input, axis=dim, keepdims=keepdim))

    return op


def _spread(fn):
    def op(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        ddof = correction if correction is not None else (0 if unbiased is False else 1)
        return fn(input, axis=_axes(dim), ddof=ddof, keepdims=keepdim)

    return op


def _softmax(fn):
    def op(input, dim=None, _stacklevel=3, dtype=None):
        if dim is None:
            raise TypeError("softmax needs dim")
        return fn(_cast(input, dtype), axis=dim)

    return op


def _cast_to(dtype):
    return lambda input: jnp.asarray(input).astype(dtype)


def _like(fill):
    def op(input, *, dtype=None):
        return jnp.full_like(input, fill, dtype=dtype_of(dtype))

    return op


def _shape(size: tuple) -> tuple:
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (list, tuple)) else tuple(size)


def _create(fill):
    def op(*size, dtype=None):
        return jnp.full(_shape(size), fill, dtype=dtype_of(dtype) or jnp.float32)

    return op


def _new(fill):
    def op(input, *size, dtype=None):
        return jnp.full(_shape(size), fill, dtype=dtype_of(dtype) or jnp.asarray(input).dtype)

    return op


def to(input, *args, dtype=None):  # device, non_blocking, copy, memory_format: NEUTRAL
    for a in args:  # x.to(torch.float32), x.to("cpu"), x.to(other), x.to("cpu", torch.float32)
        if isinstance(a, Token) and a.kind == "dtype":
            dtype = a
        elif isinstance(a, jax.Array):
            dtype = torch_dtype(a)
        elif not (isinstance(a, (str, bool)) or (isinstance(a, Token) and a.kind == "device")):
            raise TypeError(f"to(): unexpected argument {a!r}")
    return _cast(input, dtype)


def typ(input, dtype=None):
    if dtype is None:
        raise TypeError("type() without a dtype returns a string, which a loss cannot use")
    return _cast(input, dtype)


def squeeze(input, dim=None):
    x = jnp.asarray(input)
    dims = range(x.ndim) if dim is None else (dim,) if isinstance(dim, int) else dim
    keep = tuple(d % x.ndim for d in dims if x.shape[d] == 1)  # torch: a dim that is not 1 is left alone
    return jnp.squeeze(x, keep) if keep else x


def reshape(input, *shape):
    return jnp.reshape(input, _shape(shape))


def flatten(input, start_dim=0, end_dim=-1):
    x = jnp.asarray(input)
    if x.ndim == 0:
        return x.reshape(1)
    s, e = start_dim % x.ndim, end_dim % x.ndim
    return x.reshape(*x.shape[:s], -1, *x.shape[e + 1 :])


def getitem(obj, index):
    if isinstance(obj, (tuple, list)):
        return obj[index]
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(p, jax.Array) and p.dtype == jnp.bool_ for p in parts):
        raise TypeError("indexing with a boolean mask has a data-dependent shape; use torch.where instead")
    return jnp.asarray(obj)[index]


def getattr_(obj, name):
    if name == "dtype":
        return torch_dtype(obj)
    if isinstance(obj, MaxResult):
        return getattr(obj, name)
    x = jnp.asarray(obj)
    return {"shape": tuple(x.shape), "ndim": x.ndim}[name]


def nan_to_num(input, nan=0.0, posinf=None, neginf=None):
    return jnp.nan_to_num(input, nan=nan, posinf=posinf, neginf=neginf)


def softplus(input, beta=1.0, threshold=20.0):
    z = input * beta
    return jnp.where(z > threshold, input, jnp.logaddexp(0.0, z) / beta)


def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    x, axis = jnp.abs(_cast(input, dtype)), _axes(dim)
    if p in ("fro", 2, 2.0, None):
        return jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=keepdim))
    if p == float("inf"):
        return jnp.max(x, axis=axis, keepdims=keepdim)
    if isinstance(p, str):
        raise TypeError(f"norm: p={p!r}")
    return jnp.sum(x**p, axis=axis, keepdims=keepdim) ** (1.0 / p)


def div(input, other, *, rounding_mode=None):
    if rounding_mode is None:
        return operator.truediv(input, other) if _py(input, other) else jnp.true_divide(input, other)
    if rounding_mode == "floor":
        return operator.floordiv(input, other) if _py(input, other) else jnp.floor_divide(input, other)
    if rounding_mode == "trunc":
        return jnp.trunc(jnp.true_divide(input, other))
    raise TypeError(f"div(): rounding_mode {rounding_mode!r}")


def arange(start, end=None, step=1, *, dtype=None):
    start, end = (0, start) if end is None else (start, end)
    default = jnp.int32 if _py(start, end, step) and all(isinstance(v, int) for v in (start, end, step)) else None
    return jnp.arange(start, end, step, dtype=dtype_of(dtype) or default or jnp.float32)


def full(size, fill_value, *, dtype=None):
    kind = jnp.bool_ if isinstance(fill_value, bool) else jnp.int32 if isinstance(fill_value, int) else jnp.float32
    return jnp.full(_shape((size,)), fill_value, dtype=dtype_of(dtype) or kind)


# Parameters that cannot change a value: the interpreter drops them (keyword-only everywhere) before the call.
NEUTRAL = frozenset(
    {"layout", "device", "requires_grad", "pin_memory", "memory_format", "non_blocking", "copy", "sparse_grad"}
)

_UNARY = {
    "exp": jnp.exp,
    "log": jnp.log,
    "log1p": jnp.log1p,
    "expm1": jnp.expm1,
    "exp2": jnp.exp2,
    "log2": jnp.log2,
    "log10": jnp.log10,
    "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "square": jnp.square,
    "sign": jnp.sign,
    "reciprocal": jnp.reciprocal,
    "floor": jnp.floor,
    "ceil": jnp.ceil,
    "trunc": jnp.trunc,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "erf": jax.scipy.special.erf,
    "logsigmoid": jax.nn.log_sigmoid,
    "logical_not": jnp.logical_not,
    "isnan": jnp.isnan,
    "isinf": jnp.isinf,
    "isfinite": jnp.isfinite,
    "detach": jax.lax.stop_gradient,
    "float": _cast_to(jnp.float32),
    "double": _cast_to(jnp.float32),
    "half": _cast_to(jnp.float32),
    "bfloat16": _cast_to(jnp.float32),
    "long": _cast_to(jnp.int32),
    "int": _cast_to(jnp.int32),
    "bool": _cast_to(jnp.bool_),
    "t": lambda x: x if jnp.ndim(x) < 2 else jnp.swapaxes(x, 0, 1),
    "dim": jnp.ndim,
    "numel": lambda x: int(jnp.size(x)),
    "pos": lambda x: x,
    "bitwise_not": jnp.invert,
    "abs": lambda x: abs(x) if _py(x) else jnp.abs(x),
    "neg": lambda x: -x,
}

_BINARY = {
    "mul": _binary(operator.mul, jnp.multiply),
    "true_divide": _binary(operator.truediv, jnp.true_divide),
    "floor_divide": _binary(operator.floordiv, jnp.floor_divide),
    "remainder": _binary(operator.mod, jnp.remainder),
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "logaddexp": jnp.logaddexp,
    "gt": _binary(operator.gt, jnp.greater),
    "ge": _binary(operator.ge, jnp.greater_equal),
    "lt": _binary(operator.lt, jnp.less),
    "le": _binary(operator.le, jnp.less_equal),
    "eq": _binary(operator.eq, jnp.equal),
    "ne": _binary(operator.ne, jnp.not_equal),
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "logical_xor": jnp.logical_xor,
    "matmul": jnp.matmul,
    "bitwise_and": _binary(operator.and_, jnp.bitwise_and),
    "bitwise_or": _binary(operator.or_, jnp.bitwise_or),
    "bitwise_xor": _binary(operator.xor, jnp.bitwise_xor),
    "pow": _binary(operator.pow, jnp.power),
}


def _scaled(py_op, jnp_op, swap=False):
    def op(input, other, *, alpha=1):
        other = other * alpha if alpha != 1 else other
        return _binary(py_op, jnp_op)(*((other, input) if swap else (input, other)))

    return op


def _extent(fn):
    def op(input, dim=(), keepdim=False):
        return fn(input, axis=_axes(dim) if dim != () else None, keepdims=keepdim)

    return op


def _axis_op(fn):
    def op(input, dim=None, keepdim=False):
        return fn(input, axis=_axes(dim), keepdims=keepdim)

    return op


IMPLEMENTATIONS: dict[str, Any] = {
    **{op: _unary(fn) for op, fn in _UNARY.items()},
    **_BINARY,
    "relu": lambda input, inplace=False: jax.nn.relu(input),
    "round": lambda input, *, decimals=0: jnp.round(input, decimals),
    "softplus": softplus,
    "nan_to_num": nan_to_num,
    "clamp": lambda input, min=None, max=None: jnp.clip(input, min, max),
    "clamp_min": lambda input, min: jnp.maximum(input, min),
    "clamp_max": lambda input, max: jnp.minimum(input, max),
    "clone": lambda input: input,
    "contiguous": lambda input, memory_format=None: input,
    "to": to,
    "type": typ,
    "type_as": lambda input, other: jnp.asarray(input).astype(jnp.asarray(other).dtype),
    "masked_fill": lambda input, mask, value: jnp.where(mask, jnp.asarray(value, jnp.asarray(input).dtype), input),
    "where": lambda condition, input, other: jnp.where(condition, input, other),
    "add": _scaled(operator.add, jnp.add),
    "sub": _scaled(operator.sub, jnp.subtract),
    "rsub": _scaled(operator.sub, jnp.subtract, swap=True),
    "div": div,
    "sum": _reduce(jnp.sum),
    "mean": _reduce(jnp.mean),
    "nansum": _reduce(jnp.nansum),
    "prod": _reduce(jnp.prod),
    "amax": _extent(jnp.max),
    "amin": _extent(jnp.min),
    "max": _extreme(jnp.max, jnp.argmax),
    "min": _extreme(jnp.min, jnp.argmin),
    "argmax": lambda input, dim=None, keepdim=False: jnp.argmax(input, axis=dim, keepdims=keepdim),
    "argmin": lambda input, dim=None, keepdim=False: jnp.argmin(input, axis=dim, keepdims=keepdim),
    "any": _axis_op(jnp.any),
    "all": _axis_op(jnp.all),
    "logsumexp": lambda input, dim, keepdim=False: jax.scipy.special.logsumexp(input, _axes(dim), keepdims=keepdim),
    "std": _spread(jnp.std),
    "var": _spread(jnp.var),
    "norm": norm,
    "count_nonzero": lambda input, dim=None: jnp.count_nonzero(input, axis=_axes(dim)),
    "cumsum": lambda input, dim, *, dtype=None: jnp.cumsum(_cast(input, dtype), axis=dim),
    "softmax": _softmax(jax.nn.softmax),
    "log_softmax": _softmax(jax.nn.log_softmax),
    "getattr": getattr_,
    "getitem": getitem,
    "size": lambda input, dim=None: tuple(jnp.shape(input)) if dim is None else jnp.shape(input)[dim],
    "reshape": reshape,
    "flatten": flatten,
    "squeeze": squeeze,
    "unsqueeze": lambda input, dim: jnp.expand_dims(input, dim),
    "transpose": lambda input, dim0, dim1: jnp.swapaxes(input, dim0, dim1),
    "permute": lambda input, *dims: jnp.transpose(input, _shape(dims)),
    "stack": lambda tensors, dim=0: jnp.stack(tensors, axis=dim),
    "cat": lambda tensors, dim=0: jnp.concatenate(tensors, axis=dim),
    "gather": lambda input, dim, index: jnp.take_along_axis(input, index, axis=dim),
    "zeros_like": _like(0),
    "ones_like": _like(1),
    "full_like": lambda input, fill_value, *, dtype=None: jnp.full_like(input, fill_value, dtype=dtype_of(dtype)),
    "zeros": _create(0),
    "ones": _create(1),
    "full": full,
    "arange": arange,
    "new_zeros": _new(0),
    "new_ones": _new(1),
    "new_full": lambda input, size, fill_value, *, dtype=None: jnp.full(
        _shape((size,)), fill_value, dtype=dtype_of(dtype) or jnp.asarray(input).dtype
    ),
}
