from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerflow.api import request_ids

KEY, OTHER_KEY = b"k" * 32, b"o" * 32
ALICE, BOB = "a1b2c3", "d4e5f6"


@pytest.mark.parametrize(
    "ref",
    [
        request_ids.UpdateRef("training-run/sess-1:train:0", "0195-run", "seq-3-abc"),
        request_ids.WorkflowRef("sample/sess-1:sample:0/7-deadbeef"),
        request_ids.BatchItemRef("sample/sess-1:sample:0/0123456789abcdef", 41),
        request_ids.FailedRef("checkpoint tinker://x/weights/y does not exist"),
        request_ids.FailedRef("sample: prompt: chunks[1]: image data is not a valid png image", call="s:sample:0#7"),
    ],
)
def test_roundtrip_for_its_owner_only(ref):
    rid = request_ids.encode(ref, KEY, ALICE)
    assert request_ids.decode(rid, KEY, ALICE) == ref
    for key, who in ((KEY, BOB), (KEY, ""), (OTHER_KEY, ALICE)):  # another tenant, the open API, another server
        with pytest.raises(request_ids.BadRequestId):
            request_ids.decode(rid, key, who)


def test_two_calls_failed_with_one_message_are_two_futures():
    """The SDK's retrieve_futures poll keys a sampling session's futures by request id: two sample calls refused
    with the same message must not share one, or acking the first retires the second's record (its wait never ends)."""
    first, second = (request_ids.FailedRef("bad image", call=f"s:sample:0#{seq}") for seq in (7, 8))
    assert request_ids.encode(first, KEY, ALICE) != request_ids.encode(second, KEY, ALICE)


def test_an_id_built_from_a_model_id_is_refused():
    """What a tenant could build from another's model_id (the unsigned encoding request ids once had), signed or not by
    itself: neither resolves for the owner's key."""
    body = "u." + base64.urlsafe_b64encode(
        json.dumps(["training-run/sess-1:train:0", "", "create"]).encode()
    ).decode().rstrip("=")
    for forged in (
        body,
        body + ".AAAAAAAAAAAAAAAAAAAAAA",
        request_ids.encode(request_ids.UpdateRef("training-run/sess-1:train:0", "", "create"), KEY, BOB),
    ):
        with pytest.raises(request_ids.BadRequestId):
            request_ids.decode(forged, KEY, ALICE)


@pytest.mark.parametrize("bad", ["", ".", "x.abc", "u.!!!", "u." + "e30", "u.e30.", None, 7, ["u"]])
def test_garbage_is_rejected(bad):
    with pytest.raises(request_ids.BadRequestId):
        request_ids.decode(bad, KEY, ALICE)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_a_bad_request_id_never_another_error(text):
    with pytest.raises(request_ids.BadRequestId):
        request_ids.decode(text, KEY, ALICE)
