"""Ids, names and paths from callers: each check either accepts a value that is safe as a workflow id, a
visibility-query literal, a directory name and a glob-free path, or answers 400 with a message; nothing else."""

from __future__ import annotations

import pytest
from fastapi import HTTPException
from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerflow.api import identifiers
from tinkerflow.common.checkpoints import MAX_NAME_CHARS

UNSAFE = set("/\\*?[]'\"% \n\r\t\x00")
TEXT = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="ab.:/%*?-_ é\\'\n", max_size=40),
    st.sampled_from(["", ".", "..", "a" * 129, "sess-0a1b:train:0", "a:sample:1", "tinker://a/weights/b"]),
)


def _safe(value: str) -> bool:
    return not any(u in value for u in UNSAFE) and value.isascii() and value not in ("", ".", "..")


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_every_check_accepts_only_safe_values_or_answers_400(x):
    for check in (identifiers.check_session_id, identifiers.check_model_id, identifiers.check_sampler_id):
        try:
            assert _safe(check(x))
        except HTTPException as e:
            assert e.status_code == 400 and e.detail
    for path in (x, f"tinker://{x}", f"tinker://r:train:0/weights/{x}", f"tinker://{x}/weights/a"):
        try:
            p = identifiers.tinker_path(path)
            assert _safe(p.run) and _safe(p.name) and len(p.name) <= MAX_NAME_CHARS
        except HTTPException as e:
            assert e.status_code == 400 and len(e.detail) < 600  # the value is shown cut short


@pytest.mark.parametrize("good", ["sess-0a1b2c3d4e5f", "copy-abc"])
def test_ids_the_server_mints_pass(good):
    assert identifiers.check_session_id(good) == good
    assert identifiers.check_model_id(f"{good}:train:12") == f"{good}:train:12"
    assert identifiers.check_sampler_id(f"{good}:sample:3") == f"{good}:sample:3"


@pytest.mark.parametrize("bad", ["sess-1\n", "sess-1'", "*", "a" * 65, "sess/1", "", None, 7])
def test_session_ids_that_would_reach_a_query_or_workflow_id_are_refused(bad):
    with pytest.raises(HTTPException) as e:
        identifiers.check_session_id(bad)
    assert e.value.status_code == 400
