"""Server-side custom losses: the SDK's traced graph checked into a `CheckedLoss`, and the `loss_id` that carries it.

`ServiceClient.create_custom_loss(fn, input_ranks)` traces a per-datum loss with torch.fx and, when /client/config
turns `custom_loss_server_side` on, uploads it (`/api/v1/create_custom_loss`: a name, the inputs with their ranks,
`logprobs` first, and the graph as plain data, tinker.types.CustomLossGraph). `forward_backward_custom(data, handle)`
then sends an ordinary forward_backward with loss_fn "custom" and loss_fn_config {"loss_id": ...}; the engine runs
the loss per datum and sums (docs/custom-losses.md).

The check, before anything runs, refuses by name: an op outside the allow-list (custom_loss_allowlist.py), a module call
or captured tensor, arguments that do not bind to the op's signature, a reference to a node not defined before it (a
cycle, or a forward reference), nesting deeper than MAX_DEPTH, more than MAX_NODES nodes, more than MAX_LITERALS literal
scalars or an integer beyond MAX_INT (a huge constant), an output that is not (scalar loss, {metric: value}). What a
graph computes is bounded at run time by the datum's size (the engine refuses any value over its element budget while
tracing, before anything is allocated).

The `loss_id` is the checked loss itself, compressed and signed (HMAC with the server's signing key over the owner and
the session): no process stores anything, any API replica verifies it, and another tenant's or another session's use
of it is refused as an unknown loss.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

from tinkerflow.common.custom_loss_allowlist import (
    ATTRIBUTES,
    DTYPES,
    NEUTRAL_TOKENS,
    SIGNATURES,
    function_op,
    method_op,
)
from tinkerflow.common.errors import CustomLossError

MAX_NODES = 512
MAX_DEPTH = 8  # nesting of an argument: lists, tuples, dicts, slices
MAX_LITERALS = 1024  # literal scalars in all arguments together
MAX_INT = 2**31 - 1  # integers beyond it cannot be a size or an index of a datum
MAX_INPUTS = 16  # logprobs and at most 15 loss_fn_inputs (the SDK's own limit)
MAX_PAYLOAD_BYTES = 1 << 20  # a checked loss as JSON
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_INPUT = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_TOKEN_PREFIX = "cl1"


@dataclass(frozen=True)
class Ref:
    """An argument that is another node's value."""

    name: str


@dataclass(frozen=True)
class Token:
    """A dtype, device, layout or memory_format argument (`kind`), by name."""

    kind: str
    value: str


@dataclass(frozen=True)
class Call:
    name: str
    op: str  # canonical op (custom_loss_allowlist.SIGNATURES)
    args: tuple  # decoded: Python scalars, tuples, lists, dicts, slices, Ellipsis, Ref, Token
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class CheckedLoss:
    """A loss that passed the check: its inputs in order (logprobs first) and its calls in execution order."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    calls: tuple[Call, ...]
    loss: Ref
    metrics: tuple[tuple[str, Ref], ...]
    source: str  # the canonical JSON it was checked from: what the loss_id carries

    @property
    def key(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def check(name: Any, inputs: Any, nodes: Any) -> CheckedLoss:
    """Check an uploaded loss: `inputs` [{"name", "rank"}] and `nodes` as CustomLossGraph.nodes, as plain data."""
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise CustomLossError("custom loss: name must be a string of 1 to 128 characters")
    declared = _inputs(inputs)
    if not isinstance(nodes, list) or not nodes:
        raise CustomLossError(f"custom loss {name!r}: the graph has no nodes")
    if len(nodes) > MAX_NODES:
        raise CustomLossError(f"custom loss {name!r}: the graph has {len(nodes)} nodes, more than {MAX_NODES}")
    canonical = {"name": name, "inputs": [list(i) for i in declared], "nodes": []}
    defined: set[str] = set()
    placeholders: list[str] = []
    calls: list[Call] = []
    literals = [0]
    output = None
    for i, raw in enumerate(nodes):
        if not isinstance(raw, dict):
            raise CustomLossError(f"custom loss {name!r}: node {i} is not an object")
        op, node, target = raw.get("op"), raw.get("name"), raw.get("target")
        args, kwargs = raw.get("args", []), raw.get("kwargs", {})
        where = f"custom loss {name!r}, node {i} ({node!r})"
        if not isinstance(node, str) or not _NAME.fullmatch(node) or not isinstance(target, str):
            raise CustomLossError(f"{where}: a node needs a name (letters, digits, _) and a string target")
        if node in defined:
            raise CustomLossError(f"{where}: the name is used twice")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise CustomLossError(f"{where}: args must be a list and kwargs an object")
        if output is not None:
            raise CustomLossError(f"{where}: nodes after the output node")
        canonical["nodes"].append([op, node, target, args, kwargs])
        if op == "placeholder":
            expected = declared[len(placeholders)][0] if len(placeholders) < len(declared) else None
            if args or kwargs or calls or target != expected:
                raise CustomLossError(
                    f"{where}: placeholder {target!r} does not match the declared inputs "
                    f"{[n for n, _ in declared]} (in order, before any call)"
                )
            placeholders.append(node)
        elif op in ("call_function", "call_method"):
            canon = function_op(target) if op == "call_function" else method_op(target)
            if canon is None:
                kind = "function" if op == "call_function" else "method"
                raise CustomLossError(
                    f"{where}: {kind} {target!r} is not allowed in a server-side custom loss "
                    "(docs/custom-losses.md lists the operations)"
                )
            dargs = tuple(_decode(a, defined, where, 0, literals) for a in args)
            dkwargs = {str(k): _decode(v, defined, where, 0, literals) for k, v in kwargs.items()}
            _bind(canon, target, dargs, dkwargs, where)
            calls.append(Call(node, canon, dargs, dkwargs))
        elif op == "output":
            output = _output(args, defined, where, literals)
        else:  # get_attr (a captured tensor), call_module, or anything else
            raise CustomLossError(
                f"{where}: {op!r} nodes are not allowed (a custom loss reads only its inputs "
                "and calls allowed operations)"
            )
        defined.add(node)
    if len(placeholders) != len(declared):
        raise CustomLossError(f"custom loss {name!r}: {len(placeholders)} placeholders for {len(declared)} inputs")
    if output is None:
        raise CustomLossError(f"custom loss {name!r}: the graph has no output node")
    try:
        source = json.dumps(canonical, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as e:
        raise CustomLossError(f"custom loss {name!r}: the graph is not plain JSON: {e}") from None
    if len(source) > MAX_PAYLOAD_BYTES:
        raise CustomLossError(f"custom loss {name!r}: the graph is {len(source):,} bytes, over {MAX_PAYLOAD_BYTES:,}")
    loss, metrics = output
    return CheckedLoss(name, declared, tuple(calls), loss, metrics, source)


def from_source(source: str) -> CheckedLoss:
    """A CheckedLoss from its canonical JSON (the engine's side of a loss_id), checked again."""
    try:
        raw = json.loads(source)
        nodes = [dict(zip(("op", "name", "target", "args", "kwargs"), n, strict=True)) for n in raw["nodes"]]
        return check(raw["name"], [{"name": n, "rank": r} for n, r in raw["inputs"]], nodes)
    except CustomLossError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CustomLossError(f"custom loss: malformed loss: {e}") from None


def _inputs(inputs: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_INPUTS:
        raise CustomLossError(f"custom loss: inputs must list logprobs and at most {MAX_INPUTS - 1} loss_fn_inputs")
    out = []
    for item in inputs:
        name, rank = (item.get("name"), item.get("rank")) if isinstance(item, dict) else (None, None)
        if not isinstance(name, str) or not _INPUT.fullmatch(name) or rank not in (0, 1, 2) or isinstance(rank, bool):
            raise CustomLossError(f"custom loss: input {item!r} needs a lowercase name and a rank of 0, 1 or 2")
        out.append((name, int(rank)))
    if out[0][0] != "logprobs" or out[0][1] not in (1, 2):
        raise CustomLossError("custom loss: the first input must be logprobs, of rank 1 ([T]) or 2 ([T, K])")
    if len({n for n, _ in out}) != len(out):
        raise CustomLossError("custom loss: input names must be distinct")
    return tuple(out)


def _decode(arg: Any, defined: set[str], where: str, depth: int, literals: list[int]) -> Any:
    """An encoded argument (tinker.types.CustomLossNode.args) as a Python value; refs must name earlier nodes."""
    if depth > MAX_DEPTH:
        raise CustomLossError(f"{where}: arguments nested deeper than {MAX_DEPTH} levels")
    if arg is None or isinstance(arg, (bool, str)):
        if isinstance(arg, str) and len(arg) > 64:
            raise CustomLossError(f"{where}: a string argument of {len(arg)} characters")
        return arg
    if isinstance(arg, (int, float)):
        literals[0] += 1
        if literals[0] > MAX_LITERALS:
            raise CustomLossError(f"{where}: more than {MAX_LITERALS} literal values in the graph (a huge constant)")
        if isinstance(arg, int) and abs(arg) > MAX_INT:
            raise CustomLossError(f"{where}: the integer {arg} is out of range (|n| <= {MAX_INT}): a huge constant")
        if isinstance(arg, float) and not math.isfinite(arg):  # the SDK encodes these as {"float": "inf"}
            raise CustomLossError(f"{where}: a bare non-finite number; encode it as {{'float': 'inf'}}")
        return arg
    if isinstance(arg, list):
        return [_decode(a, defined, where, depth + 1, literals) for a in arg]
    if not (isinstance(arg, dict) and len(arg) == 1):
        raise CustomLossError(f"{where}: cannot decode argument {str(arg)[:80]}")
    ((kind, value),) = arg.items()
    if kind == "ref":
        if value not in defined:
            raise CustomLossError(
                f"{where}: refers to {value!r}, which is not defined before it (nodes must be in "
                "execution order: no cycles or forward references)"
            )
        return Ref(value)
    if kind == "tuple" and isinstance(value, list):
        return tuple(_decode(a, defined, where, depth + 1, literals) for a in value)
    if kind == "dict" and isinstance(value, dict):
        return {str(k): _decode(v, defined, where, depth + 1, literals) for k, v in value.items()}
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        return slice(*(_decode(a, defined, where, depth + 1, literals) for a in value))
    if kind == "ellipsis" and value is True:
        return Ellipsis
    if kind == "float" and value in ("inf", "-inf", "nan"):
        return float(value)
    if kind == "dtype" and value in DTYPES:
        return Token("dtype", value)
    if kind in NEUTRAL_TOKENS and isinstance(value, str) and value.split(":")[0] in NEUTRAL_TOKENS[kind]:
        return Token(kind, value)
    raise CustomLossError(f"{where}: argument {{{kind!r}: {str(value)[:40]!r}}} is not allowed")


def _bind(op: str, target: str, args: tuple, kwargs: dict[str, Any], where: str) -> None:
    try:
        SIGNATURES[op].bind(*args, **kwargs)
    except TypeError as e:
        raise CustomLossError(f"{where}: {target}: {e}") from None
    if op == "getattr" and (len(args) != 2 or args[1] not in ATTRIBUTES):
        raise CustomLossError(f"{where}: attribute {args[1:]!r} is not readable (only {sorted(ATTRIBUTES)})")
    if kwargs.get("inplace") or (args[1:2] == (True,) and op == "relu"):
        raise CustomLossError(f"{where}: {target} in place is not allowed")


def _output(args: list, defined: set[str], where: str, literals: list[int]) -> tuple[Ref, tuple[tuple[str, Ref], ...]]:
    value = _decode(args[0], defined, where, 0, literals) if len(args) == 1 else None
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], Ref)):
        raise CustomLossError(f"{where}: the output must be (loss, metrics) with the loss a computed tensor")
    loss, metrics = value
    if not isinstance(metrics, dict):
        raise CustomLossError(f"{where}: the output's metrics must be a dict")
    for key, ref in metrics.items():
        if not _METRIC.fullmatch(key) or not isinstance(ref, Ref):
            raise CustomLossError(f"{where}: metric {key!r} must be named custom/<name>:sum or :mean and be a tensor")
    return loss, tuple(sorted(metrics.items()))


# ---------------------------------------------------------------------------------------------------- loss ids


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(key: bytes, owner: str, session_id: str, body: str) -> str:
    mac = hmac.new(key, f"custom-loss\n{owner}\n{session_id}\n{body}".encode(), hashlib.sha256).digest()[:16]
    return _b64(mac)


def loss_id(loss: CheckedLoss, session_id: str, key: bytes, owner: str) -> str:
    """The loss_id for `loss`, created in `session_id` by `owner`: the loss itself, compressed and signed."""
    body = _b64(zlib.compress(json.dumps([session_id, loss.source]).encode(), 9))
    return f"{_TOKEN_PREFIX}.{body}.{_signature(key, owner, session_id, body)}"


def verify(token: Any, session_id: str, key: bytes, owner: str) -> bool:
    """Whether `token` is a loss_id this server gave `owner` in `session_id`."""
    if not isinstance(token, str) or token.count(".") != 2 or not token.startswith(_TOKEN_PREFIX + "."):
        return False
    _, body, signature = token.split(".")
    return hmac.compare_digest(signature.encode(), _signature(key, owner, session_id, body).encode())


def source_of(token: str) -> str:
    """The canonical JSON inside a loss_id (whose signature the API verified before the op was admitted)."""
    try:
        body = token.split(".")[1]
        raw = zlib.decompressobj().decompress(_unb64(body), MAX_PAYLOAD_BYTES + 1024)
        _, source = json.loads(raw)
        return str(source)
    except (IndexError, ValueError, zlib.error, TypeError) as e:
        raise CustomLossError(f"malformed loss_id: {e}") from None
