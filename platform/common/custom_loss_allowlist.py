"""The operations a server-side custom loss may call: the allow-list, with torch's own parameter names.

A traced loss (tinker.types.CustomLossGraph) names each call by torch.fx's target: a function's qualified name
(`torch.exp`, `operator.mul`, `torch.nn.functional.log_softmax`, `getattr`) or a Tensor method's name (`sum`,
`clamp`). Both map here to one canonical operation with one signature; a call's arguments must bind to it (checked
when the loss is created), and the engine implements each operation with exactly that signature (its tests compare
the two tables). Anything not listed is refused by name: other torch functions, in-place methods (`add_`), modules,
captured tensors, calls that leave torch (`item`, `tolist`).

Arguments that cannot change a value are accepted and have no effect: `device`, `layout`, `memory_format`,
`requires_grad`, `non_blocking`, `copy`, F.softmax's `_stacklevel`. Every floating dtype computes in float32 and every
integer one in int32 (the engine's precision); `inplace=True` is refused.
"""

from __future__ import annotations

import inspect

_CREATE = "dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False"  # keyword-only
_LIKE = "*, dtype=None, layout=None, device=None, requires_grad=False, memory_format=None"

# dtype casts: unary ops, and methods only (no torch.<op> function of these names).
_CASTS = ("float", "double", "half", "bfloat16", "long", "int", "bool")
_UNARY = (
    "exp",
    "log",
    "log1p",
    "expm1",
    "exp2",
    "log2",
    "log10",
    "sqrt",
    "rsqrt",
    "abs",
    "neg",
    "sigmoid",
    "tanh",
    "square",
    "sign",
    "reciprocal",
    "floor",
    "ceil",
    "trunc",
    "sin",
    "cos",
    "erf",
    "logsigmoid",
    "logical_not",
    "isnan",
    "isinf",
    "isfinite",
    "detach",
    *_CASTS,
    "t",
    "dim",
    "numel",
    "pos",
    "bitwise_not",
)
_BINARY = (
    "mul",
    "true_divide",
    "floor_divide",
    "remainder",
    "maximum",
    "minimum",
    "logaddexp",
    "gt",
    "ge",
    "lt",
    "le",
    "eq",
    "ne",
    "logical_and",
    "logical_or",
    "logical_xor",
    "matmul",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
)

# canonical op -> parameters, as torch names them (for methods the tensor is the first parameter).
_PARAMS: dict[str, str] = {
    **dict.fromkeys(_UNARY, "input"),
    "relu": "input, inplace=False",
    "round": "input, *, decimals=0",
    "softplus": "input, beta=1.0, threshold=20.0",
    "nan_to_num": "input, nan=0.0, posinf=None, neginf=None",
    "clamp": "input, min=None, max=None",
    "clamp_min": "input, min",
    "clamp_max": "input, max",
    "clone": "input, *, memory_format=None",
    "contiguous": "input, memory_format=None",
    "to": "input, *args, dtype=None, device=None, non_blocking=False, copy=False, memory_format=None",
    "type": "input, dtype=None, *, non_blocking=False",
    "type_as": "input, other",
    "masked_fill": "input, mask, value",
    "where": "condition, input, other",
    **dict.fromkeys(_BINARY, "input, other"),
    "add": "input, other, *, alpha=1",
    "sub": "input, other, *, alpha=1",
    "rsub": "input, other, *, alpha=1",
    "div": "input, other, *, rounding_mode=None",
    "pow": "input, exponent",
    **dict.fromkeys(("sum", "mean", "nansum", "prod"), "input, dim=None, keepdim=False, *, dtype=None"),
    **dict.fromkeys(("amax", "amin"), "input, dim=(), keepdim=False"),
    **dict.fromkeys(("max", "min", "argmax", "argmin", "any", "all"), "input, dim=None, keepdim=False"),
    "logsumexp": "input, dim, keepdim=False",
    **dict.fromkeys(("std", "var"), "input, dim=None, unbiased=None, keepdim=False, *, correction=None"),
    "norm": "input, p='fro', dim=None, keepdim=False, dtype=None",
    "count_nonzero": "input, dim=None",
    "cumsum": "input, dim, *, dtype=None",
    **dict.fromkeys(("softmax", "log_softmax"), "input, dim=None, _stacklevel=3, dtype=None"),
    "getattr": "obj, name",
    "getitem": "obj, index",
    "size": "input, dim=None",
    "reshape": "input, *shape",
    "flatten": "input, start_dim=0, end_dim=-1",
    "squeeze": "input, dim=None",
    "unsqueeze": "input, dim",
    "transpose": "input, dim0, dim1",
    "permute": "input, *dims",
    "stack": "tensors, dim=0",
    "cat": "tensors, dim=0",
    "gather": "input, dim, index, *, sparse_grad=False",
    **dict.fromkeys(("zeros_like", "ones_like"), f"input, {_LIKE}"),
    "full_like": f"input, fill_value, {_LIKE}",
    **dict.fromkeys(("zeros", "ones"), f"*size, {_CREATE}"),
    "full": f"size, fill_value, *, {_CREATE}",
    "arange": f"start, end=None, step=1, *, {_CREATE}",
    **dict.fromkeys(("new_zeros", "new_ones"), f"input, *size, {_CREATE}"),
    "new_full": f"input, size, fill_value, *, {_CREATE}",
}

# The signatures, built from the constant strings above (never from user input).
SIGNATURES: dict[str, inspect.Signature] = {
    op: inspect.signature(eval(f"lambda {params}: None")) for op, params in _PARAMS.items()
}

# Method names that differ from their canonical op.
_METHOD_ALIASES = {
    "clip": "clamp",
    "view": "reshape",
    "absolute": "abs",
    "negative": "neg",
    "multiply": "mul",
    "divide": "div",
    "subtract": "sub",
    "greater": "gt",
    "greater_equal": "ge",
    "less": "lt",
    "less_equal": "le",
    "not_equal": "ne",
    "fix": "trunc",
}
# Functions outside `torch.<op>` that the SDK's tracer records.
_FUNCTION_NAMES = {
    "torch.nn.functional.softmax": "softmax",
    "torch.nn.functional.log_softmax": "log_softmax",
    "torch.nn.functional.relu": "relu",
    "torch.nn.functional.logsigmoid": "logsigmoid",
    "torch._C._nn.log_sigmoid": "logsigmoid",
    "torch.nn.functional.softplus": "softplus",
    "torch._C._nn.softplus": "softplus",
    "torch.nn.functional.sigmoid": "sigmoid",
    "torch.nn.functional.tanh": "tanh",
    "getattr": "getattr",
    "operator.add": "add",
    "operator.sub": "sub",
    "operator.mul": "mul",
    "operator.truediv": "true_divide",
    "operator.floordiv": "floor_divide",
    "operator.mod": "remainder",
    "operator.pow": "pow",
    "operator.neg": "neg",
    "operator.pos": "pos",
    "operator.abs": "abs",
    "operator.gt": "gt",
    "operator.ge": "ge",
    "operator.lt": "lt",
    "operator.le": "le",
    "operator.eq": "eq",
    "operator.ne": "ne",
    "operator.and_": "bitwise_and",
    "operator.or_": "bitwise_or",
    "operator.xor": "bitwise_xor",
    "operator.invert": "bitwise_not",
    "operator.getitem": "getitem",
    "operator.matmul": "matmul",
}
# Ops with no torch.<op> function of this name (methods only, or Python-level ones).
_METHOD_ONLY = {
    *_CASTS,
    "to",
    "type",
    "type_as",
    "size",
    "dim",
    "contiguous",
    "new_zeros",
    "new_ones",
    "new_full",
    "getattr",
    "getitem",
    "pos",
}

# Attributes `getattr` may read: a tensor's shape and rank, a dtype, the two fields of max/min with a dim.
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "values", "indices"})
# dtypes an argument may name, as the SDK encodes them ({"dtype": "float32"}).
DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"})
# Non-value tokens (no effect on any value): the only ones the SDK's encoding allows besides dtypes.
NEUTRAL_TOKENS = {
    "device": frozenset({"cpu", "cuda", "meta"}),
    "layout": frozenset({"strided"}),
    "memory_format": frozenset({"contiguous_format", "preserve_format"}),
}


def function_op(target: str) -> str | None:
    """The canonical op of a call_function target, or None when it is not allowed."""
    if target in _FUNCTION_NAMES:
        return _FUNCTION_NAMES[target]
    if target.startswith("torch.") and target.count(".") == 1:
        op = target.removeprefix("torch.")
        op = {"clip": "clamp", "concat": "cat", "concatenate": "cat", "absolute": "abs", "negative": "neg"}.get(op, op)
        if op in SIGNATURES and op not in _METHOD_ONLY:
            return op
    return None


def method_op(target: str) -> str | None:
    """The canonical op of a call_method target, or None when it is not allowed (in-place methods end in `_`)."""
    op = _METHOD_ALIASES.get(target, target)
    # where: Tensor.where(condition, other) puts the tensor second; zeros/ones/...: not methods.
    if op in SIGNATURES and op not in (
        "getattr",
        "getitem",
        "where",
        "zeros",
        "ones",
        "full",
        "arange",
        "stack",
        "cat",
    ):
        return op
    return None
