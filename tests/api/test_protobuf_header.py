"""The forward_backward header read off the wire equals the full protobuf parse's fields, for any body the SDK's own
protobuf module writes; a body whose top level does not parse is refused, as the full parse refuses it."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from tinkerflow.api.protobuf_header import read_forward_backward_header


def _body(model_id: str, seq_id: int, datums: int, loss_fn: str = "cross_entropy") -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=True)
    for i in range(datums):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = bytes(range(i, i + 20))
    return msg.SerializeToString()


@settings(max_examples=60, deadline=None)
@given(
    model_id=st.text(max_size=40),
    seq_id=st.integers(-(2**31), 2**31 - 1),
    datums=st.integers(0, 20),
)
def test_the_header_equals_the_full_parse(model_id, seq_id, datums):
    body = _body(model_id, seq_id, datums)
    full = pb.ForwardBackwardRequest.FromString(body)
    got = read_forward_backward_header(body)
    assert (got.model_id, got.seq_id, got.datums) == (full.model_id, full.seq_id, len(full.data))


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200))
def test_garbage_the_full_parse_refuses_is_refused_or_read_alike(body):
    """Whatever the header reader accepts, the full parse reads the same three fields from (or refuses as well in
    the datums, which the worker then reports through the op's future)."""
    try:
        got = read_forward_backward_header(body)
    except ValueError:
        return
    try:
        full = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError:
        return  # malformed inside a datum or a config entry: the worker's full parse fails the op, in sequence
    assert (got.model_id, got.seq_id, got.datums) == (full.model_id, full.seq_id, len(full.data))


@pytest.mark.parametrize(
    "body,why",
    [(b"\xff\xff\xff\xff garbage", "wire type"), (_body("m", 1, 3)[:-4], "past the end"), (b"\xff", "varint")],
)
def test_malformed_top_levels_are_refused(body, why):
    with pytest.raises(ValueError, match=why):
        read_forward_backward_header(body)
