"""The few top-level fields the API needs from a protobuf forward_backward body, read off the wire format without
decoding its datums.

A ForwardBackwardRequest of thousands of datums is decoded once, by the JAX worker that runs it (activities/wire.py);
the API only routes it: it needs the run (`model_id`), the op's place in its sequence (`seq_id`) and the number of
datums (the per-request cap). Walking the top-level fields and skipping each length-delimited one costs a varint
read per field, where a full parse builds every datum's message. A body whose top level does not parse (garbage, a
field running past the end, a wire type protobuf does not have) is refused like a failed full parse.
"""

from __future__ import annotations

from dataclasses import dataclass

# tinker_public.ForwardBackwardRequest: model_id = 1 (string), seq_id = 2 (int32), data = 3 (repeated Datum),
# loss_fn = 4 (string), loss_fn_config = 5 and loss_fn_config_v2 = 7 (maps). Datum.model_input = 1 (repeated
# Chunk), Chunk.encoded_text = 1, EncodedTextChunk.tokens = 1 (int32s, little-endian).
MODEL_ID, SEQ_ID, DATA = 1, 2, 3
MODEL_INPUT = ENCODED_TEXT = TOKENS = 1
LOSS_FIELDS = (4, 5, 7)
VARINT, I64, LEN, I32 = 0, 1, 2, 5


@dataclass(frozen=True)
class ForwardBackwardHeader:
    model_id: str
    seq_id: int
    datums: int
    # The loss fields as they are on the wire (small): a ForwardBackwardRequest of its own, without the datums, for
    # the checks that need the loss (a custom loss's loss_id).
    loss_fields: bytes = b""


def _varint(body: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(body) or shift > 63:
            raise ValueError("a varint runs past the end of the body")
        byte = body[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def read_forward_backward_header(body: bytes) -> ForwardBackwardHeader:
    """model_id, seq_id (int32, negatives as protobuf encodes them) and datum count; ValueError when malformed."""
    model_id, seq_id, datums, at = "", 0, 0, 0
    loss_fields: list[bytes] = []
    while at < len(body):
        start = at
        tag, at = _varint(body, at)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == VARINT:
            value, at = _varint(body, at)
            if field == SEQ_ID:
                value &= 0xFFFFFFFF  # int32: the low 32 bits, two's complement
                seq_id = value - (1 << 32) if value >= 1 << 31 else value
        elif wire == LEN:
            length, at = _varint(body, at)
            end = at + length
            if end > len(body):
                raise ValueError(f"field {field} runs {end - len(body)} bytes past the end of the body")
            if field == MODEL_ID:
                try:
                    model_id = body[at:end].decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"model_id is not UTF-8: {e}") from None
            elif field == DATA:
                datums += 1
            elif field in LOSS_FIELDS:
                loss_fields.append(body[start:end])
            at = end
        elif wire in (I64, I32):
            at += 8 if wire == I64 else 4
            if at > len(body):
                raise ValueError(f"field {field} runs past the end of the body")
        else:
            raise ValueError(f"wire type {wire} of field {field} is not protobuf's")
    return ForwardBackwardHeader(model_id, seq_id, datums, b"".join(loss_fields))


def walk_fields(body: bytes, start: int, end: int):
    """(field number, value start, value end) of the length-delimited fields in body[start:end]; stops quietly at
    anything malformed (what it cannot walk, the JAX worker refuses when it decodes the datums)."""
    at = start
    while at < end:
        try:
            tag, at = _varint(body, at)
            wire = tag & 7
            if wire == VARINT:
                _, at = _varint(body, at)
                continue
            if wire in (I64, I32):
                at += 8 if wire == I64 else 4
                continue
            if wire != LEN:
                return
            length, at = _varint(body, at)
        except ValueError:
            return
        if at + length > end:
            return
        yield tag >> 3, at, at + length
        at += length


def input_tokens(body: bytes) -> int:
    """The input tokens of a ForwardBackwardRequest's datums, as the meter counts them (training_tokens), walked off
    the wire like the header: what the training quota charges the op (platform/api/quota_checks.py)."""
    tokens = 0
    for field, start, end in walk_fields(body, 0, len(body)):
        if field != DATA:
            continue
        for f, chunk_start, chunk_end in walk_fields(body, start, end):
            if f != MODEL_INPUT:
                continue
            for g, text_start, text_end in walk_fields(body, chunk_start, chunk_end):
                if g == ENCODED_TEXT:
                    tokens += sum((e - s) // 4 for h, s, e in walk_fields(body, text_start, text_end) if h == TOKENS)
    return tokens
