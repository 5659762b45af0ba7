from __future__ import annotations

import pytest

from tinkerflow.api import request_ids


@pytest.mark.parametrize("ref", [
    request_ids.UpdateRef("training-run/sess-1:train:0", "0195-run", "seq-3-abc"),
    request_ids.WorkflowRef("sample/sess-1:sample:0/7-deadbeef"),
    request_ids.BatchItemRef("sample/sess-1:sample:0/0123456789abcdef", 41),
])
def test_roundtrip(ref):
    assert request_ids.decode(request_ids.encode(ref)) == ref


@pytest.mark.parametrize("bad", ["", "x.abc", "u.!!!", "u." + "e30"])
def test_garbage_is_rejected(bad):
    with pytest.raises(request_ids.BadRequestId):
        request_ids.decode(bad)
