"""Converters between the Tinker wire formats (the SDK's own protobuf module and JSON models) and engine types.

Decoding failures raise `InputError`, so a malformed datum fails only its own future, with a message that says
which datum and which field.

A forward_backward datum's and a sample prompt's `ImageChunk`s become placeholder tokens and patch rows
(`Datum.images`, `SampleInput.images`) through one converter, wire_images.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb
from tinker.types import SampleRequest
from tinker.types._pydantic_types.tensor_data import TensorData as TensorDataModel

from tinkerflow.activities.wire_images import ImageRules, json_parts, model_tokens, proto_parts
from tinkerflow.workers.engine.sampling.decode import MAX_TARGET_PROMPT_LOGPROBS
from tinkerflow.workers.engine.types import (
    Datum,
    ForwardBackwardInput,
    ForwardBackwardResult,
    InputError,
    SampleInput,
    SampleResult,
)

_PROTO_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_NUMPY_TO_PROTO = {
    np.dtype(np.float32): pb.DTYPE_FLOAT32,
    np.dtype(np.int64): pb.DTYPE_INT64,
    np.dtype(np.int32): pb.DTYPE_INT32,
}
# Densified sparse inputs are padded with 0 for every key the SDK sends sparse (target_tokens, weights).
_PAD_VALUE = 0


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The API routed this body by its top-level fields alone, so its datums are first decoded here: a body that
    does not parse fails its own op as the client's error."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise InputError(
            f"the forward_backward body is not a valid ForwardBackwardRequest protobuf ({e}); send it "
            "as the SDK encodes it"
        ) from e
    return msg


@dataclass(frozen=True)
class Bounds:
    """What the served model makes sensible, checked before anything is allocated: a sparse tensor declares its
    shape, and a shape of [4, 2**40] would otherwise ask for 32 TiB. Rows are positions (at most the context),
    columns at most the vocabulary (top-k targets, one column per candidate token)."""

    max_rows: int = 1 << 20
    max_cols: int = 1 << 20


def _tensor(name: str, t: pb.Tensor, where: str, bounds: Bounds = Bounds()) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(t.dtype)
    if dtype is None:
        # A value outside the enum (protobuf keeps unknown enum numbers) has no name: say the number instead.
        known = t.dtype in pb.DType.values()
        label = pb.DType.Name(t.dtype) if known else f"{t.dtype} (not a DType)"
        raise InputError(f"{where}: loss_fn_inputs[{name!r}] has unsupported dtype {label}")
    shape = tuple(int(s) for s in t.shape)
    if any(s < 0 for s in shape):
        raise InputError(f"{where}: loss_fn_inputs[{name!r}] has a negative dimension in shape {list(shape)}")
    try:
        which = t.WhichOneof("encoding")
        if which == "sparse_csr":
            values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
            crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
            if len(shape) != 2:
                raise InputError(f"{where}: sparse loss_fn_inputs[{name!r}] needs a 2-D shape, got {list(shape)}")
            if shape[0] > bounds.max_rows or shape[1] > bounds.max_cols:
                raise InputError(
                    f"{where}: sparse loss_fn_inputs[{name!r}] declares shape {list(shape)}, beyond this model's "
                    f"context ({bounds.max_rows} rows) or vocabulary ({bounds.max_cols} columns)"
                )
            if (
                len(crow) != shape[0] + 1
                or len(col) != len(values)
                or (col.size and not (int(col.min()) >= 0 and int(col.max()) < shape[1]))
            ):
                raise InputError(
                    f"{where}: sparse loss_fn_inputs[{name!r}] has crow/col indices that do not fit shape {list(shape)}"
                )
            dense = np.full(shape, _PAD_VALUE, dtype=dtype)
            for row in range(shape[0]):
                lo, hi = int(crow[row]), int(crow[row + 1])
                dense[row, col[lo:hi]] = values[lo:hi]
            return dense
        arr = np.frombuffer(t.dense, dtype=dtype)
    except (ValueError, IndexError) as e:
        raise InputError(f"{where}: loss_fn_inputs[{name!r}] is malformed: {e}") from None
    if shape:
        if math.prod(shape) != arr.size:
            raise InputError(f"{where}: loss_fn_inputs[{name!r}] has {arr.size} values but shape {list(shape)}")
        arr = arr.reshape(shape)
    return arr.copy()


def _sampled_mask(spans: Sequence[pb.ProvenanceSpan], where: str) -> np.ndarray | None:
    """The target positions a SampledProvenanceSpan covers (1.0), from runs that tile target_tokens in order
    (`Datum.with_provenance`); None when the datum has no provenance. Sequence ids are looked up by
    activities/stability_checks.py (stable_reinforce), not here."""
    if not spans:
        return None
    parts: list[np.ndarray] = []
    for j, span in enumerate(spans):
        which = span.WhichOneof("span")
        if which is None:
            raise InputError(f"{where}: loss_fn_input_spans[{j}] is neither a prompt nor a sampled span")
        arm = getattr(span, which)
        if arm.length < 0 or arm.offset < 0 or not arm.sequence_id:
            raise InputError(f"{where}: loss_fn_input_spans[{j}] needs a sequence_id, offset >= 0 and length >= 0")
        parts.append(np.full((arm.length,), 1.0 if which == "sampled_tokens" else 0.0, np.float32))
    return np.concatenate(parts)


def forward_backward_input(
    msg: pb.ForwardBackwardRequest, slot: int, bounds: Bounds = Bounds(), images: ImageRules | None = None
) -> ForwardBackwardInput:
    """The engine's input; `images`: the served model's rules for ImageChunks (None: text chunks only)."""
    data: list[Datum] = []
    for i, d in enumerate(msg.data):
        where = f"datum {i}"
        chunks = f"{where}: model_input"
        tokens, datum_images = model_tokens(proto_parts(d.model_input, chunks), chunks, images)
        data.append(
            Datum(
                tokens=tokens,
                inputs={k: _tensor(k, v, where, bounds) for k, v in d.loss_fn_inputs.items()},
                sampled_mask=_sampled_mask(d.loss_fn_input_spans, where),
                images=datum_images,
            )
        )
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for k, v in msg.loss_fn_config_v2.items():  # v2 carries every entry, strings included: prefer it
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    return ForwardBackwardInput(
        slot=slot, data=data, loss_fn=msg.loss_fn, loss_fn_config=config, forward_only=msg.forward_only
    )


def forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """One ArrayRecord holding every datum: per field, concatenated data plus int64 byte offsets
    (docs/wire-contract.md §Binary results)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in result.metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(result.outputs))
    fields = sorted({k for o in result.outputs for k in o})
    for name in fields:
        arrays = [np.ascontiguousarray(o[name]) for o in result.outputs]
        dtype = arrays[0].dtype if arrays[0].dtype in _NUMPY_TO_PROTO else np.dtype(np.float32)
        arrays = [a.astype(dtype, copy=False) for a in arrays]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = _NUMPY_TO_PROTO[dtype]
        bt.trailing_shape.extend(arrays[0].shape[1:])
    return out.SerializeToString()


# optim_step metrics on the wire. Tinker's optim_step metrics are free-form and the cookbook's loops merge them
# into their own per-step metrics (`metrics.update(optim_result.metrics)` in supervised.train, rl.train, rl_loop,
# sdft), where they would overwrite the loop's own keys: `step` (its metrics.jsonl step column), `learning_rate`,
# `progress`, `optim/lr`, `optim/entropy`. So every key we answer lives under our own `tinkerflow/` prefix, which
# no loop writes.
OPTIM_METRICS_PREFIX = "tinkerflow/"
_OPTIM_METRIC_NAMES = {"grad_norm": "grad_norm", "learning_rate": "learning_rate", "step": "adapter_optim_steps"}


def optim_step_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The engine's optim_step metrics under names no client loop writes itself."""
    return {OPTIM_METRICS_PREFIX + _OPTIM_METRIC_NAMES.get(k, k): float(v) for k, v in metrics.items()}


def sample_input(body: bytes, snapshot: str | None, images: ImageRules | None = None) -> SampleInput:
    """The engine's input; `images`: the served model's rules for the prompt's ImageChunks (None: text chunks only)."""
    try:
        req = SampleRequest.model_validate(json.loads(body))
    except Exception as e:
        raise InputError(f"malformed sample request: {e}") from None
    tokens, prompt_images = model_tokens(json_parts(req.prompt.chunks), "prompt", images)
    p = req.sampling_params
    stop = p.stop
    # The stop rule (docs/wire-contract.md §Sampling): None and strings keep EOS; [] stops at nothing; ids add EOS.
    if stop is None:
        stop_ids, stop_strings = None, []
    elif isinstance(stop, str):
        stop_ids, stop_strings = None, [stop]
    elif all(isinstance(s, int) for s in stop):
        stop_ids, stop_strings = [int(s) for s in stop], []
    else:
        stop_ids, stop_strings = None, [str(s) for s in stop]
    if req.num_samples < 1:
        raise InputError(f"num_samples must be at least 1, got {req.num_samples}")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {p.max_tokens}")
    return SampleInput(
        prompt=tokens,
        images=prompt_images,
        num_samples=req.num_samples,
        max_tokens=p.max_tokens if p.max_tokens is not None else 16,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        include_prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=int(req.topk_prompt_logprobs or 0),
        snapshot=snapshot or None,
        topk_sample_logprobs=int(req.topk_sample_logprobs or 0),
        target_prompt_logprobs=_target_ids(req.target_prompt_logprobs),
        prompt_alt_tokens_k=int(req.prompt_alt_tokens_k or 0),
        prompt_logprobs_last_n=req.prompt_logprobs_last_n,
        # record_stability_info is the activity's (activities/stability_checks.py records the sampled call): the engine
        # samples the same either way.
        cache_namespace=req.sampling_session_id or None,
    )


def _target_ids(t: TensorDataModel | None) -> np.ndarray | None:
    """target_prompt_logprobs as dense int64 [rows, K] with -1 where nothing is asked (CSR: unlisted cells)."""
    if t is None:
        return None
    shape = [int(x) for x in (t.shape or [])]
    if len(shape) != 2 or shape[0] > Bounds().max_rows or not 0 < shape[1] <= MAX_TARGET_PROMPT_LOGPROBS:
        raise InputError(
            f"target_prompt_logprobs must be [len(prompt) - 1, K] with 1 <= K <= {MAX_TARGET_PROMPT_LOGPROBS}, "
            f"got shape {shape}"
        )
    if t.dtype != "int64":
        raise InputError(f"target_prompt_logprobs must be int64 token ids, got {t.dtype}")
    values = np.asarray(t.data, dtype=np.int64).reshape(-1)
    if t.sparse_crow_indices is None:
        if values.size != shape[0] * shape[1]:
            raise InputError(f"target_prompt_logprobs has {values.size} values but shape {shape}")
        return values.reshape(shape)
    crow = np.asarray(t.sparse_crow_indices, np.int64)
    col = np.asarray(t.sparse_col_indices or [], np.int64)
    if (
        len(crow) != shape[0] + 1
        or len(col) != len(values)
        or (crow.size and (crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0)))
        or (col.size and (col.min() < 0 or col.max() >= shape[1]))
    ):
        raise InputError(f"target_prompt_logprobs: CSR crow/col indices do not fit shape {shape}")
    dense = np.full(shape, -1, np.int64)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return dense


def sample_output(result: SampleResult, request: bytes | None = None) -> bytes:
    """The SampleResponse protobuf; `request` (the SampleRequest body) gives target_prompt_logprobs its layout back
    (a CSR request is answered in CSR, at the cells it listed)."""
    out = pb.SampleResponse()
    out.prompt_cache_hit_tokens = result.prompt_cache_hit_tokens
    for seq in result.sequences:
        s = out.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _topk(s.topk_sampled_logprobs, *seq.topk_logprobs)
    if result.target_prompt_logprobs is not None:
        _target_answer(out.target_prompt_logprobs, result.target_prompt_logprobs, request)
    if result.prompt_alt_tokens is not None:
        ids, lps = result.prompt_alt_tokens
        _dense(out.prompt_alt_tokens.tokens, np.asarray(ids, np.int64), pb.DTYPE_INT64)
        _dense(out.prompt_alt_tokens.logprobs, np.asarray(lps, np.float32), pb.DTYPE_FLOAT32)
    if result.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in result.prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if result.topk_prompt_logprobs is not None:
        _topk(out.topk_prompt_logprobs, *result.topk_prompt_logprobs)
    return out.SerializeToString()


def _topk(msg: pb.TopkLogprobs, ids: np.ndarray, lps: np.ndarray) -> None:
    """Row-major [length, k] int32 ids and float32 log-probs (docs/wire-contract.md §Binary results); k == 0 or
    length == 0 means None."""
    length, k = ids.shape
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
    msg.k = k
    msg.length = length


def _dense(msg: pb.Tensor, arr: np.ndarray, dtype: pb.DType.ValueType) -> None:
    msg.dtype = dtype
    msg.shape.extend(arr.shape)
    msg.dense = np.ascontiguousarray(arr).tobytes()


def _target_answer(msg: pb.Tensor, values: np.ndarray, request: bytes | None) -> None:
    """float32 log-probs in the request's layout: dense, or CSR at the cells the request listed."""
    values = np.asarray(values, np.float32)
    asked: dict[str, Any] = (json.loads(request).get("target_prompt_logprobs") or {}) if request else {}
    if asked.get("sparse_crow_indices") is None:
        _dense(msg, values, pb.DTYPE_FLOAT32)
        return
    crow: np.ndarray = np.asarray(asked["sparse_crow_indices"], np.int64)
    col = np.asarray(asked.get("sparse_col_indices") or [], np.int64)
    msg.dtype = pb.DTYPE_FLOAT32
    msg.shape.extend(values.shape)
    msg.sparse_csr.crow_indices = crow.tobytes()
    msg.sparse_csr.col_indices = col.tobytes()
    rows: np.ndarray = np.repeat(np.arange(values.shape[0], dtype=np.int64), np.diff(crow))
    msg.sparse_csr.values = values[rows, col].tobytes()
