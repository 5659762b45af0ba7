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


@settings(max_examples=60, deadline=None)
@given(
    loss_fn=st.text(max_size=20),
    numbers=st.dictionaries(st.text(max_size=10), st.floats(allow_nan=False), max_size=3),
    texts=st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=3),
)
def test_the_loss_fields_parse_as_the_full_parse_does(loss_fn, numbers, texts):
    """The loss fields the header keeps (for a custom loss's loss_id) decode to the full parse's loss and configs."""
    msg = pb.ForwardBackwardRequest.FromString(_body("m", 3, 2, loss_fn))
    for k, v in numbers.items():
        msg.loss_fn_config[k] = v
        msg.loss_fn_config_v2[k].number = v
    for k, v in texts.items():
        msg.loss_fn_config_v2[k].text = v
    full = pb.ForwardBackwardRequest.FromString(msg.SerializeToString())
    got = pb.ForwardBackwardRequest.FromString(read_forward_backward_header(msg.SerializeToString()).loss_fields)
    assert (got.loss_fn, dict(got.loss_fn_config), dict(got.loss_fn_config_v2)) == (
        full.loss_fn,
        dict(full.loss_fn_config),
        dict(full.loss_fn_config_v2),
    )
    assert not got.data
