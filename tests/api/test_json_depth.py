"""The bound on JSON nesting (api/json_depth.py): a body nested past MAX_JSON_DEPTH is a 400 naming the limit on
every route, /telemetry (which never reads its body) included; the scan counts what a parser would nest into and
nothing inside strings; what passes reaches the route byte for byte."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from unittest import mock

from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from temporalio.client import Client
from tinker.types import TelemetrySendRequest
from tinker.types.generic_event import GenericEvent

from tinkerflow.api import json_depth as depth_module
from tinkerflow.api.app import create_app
from tinkerflow.api.body_limits import BodyLimit
from tinkerflow.api.json_depth import MAX_JSON_DEPTH, JsonDepthLimit, json_depth
from tinkerflow.cli.launch import free_port
from tinkerflow.common.settings import Settings

KEY = "tml-json-depth"
DEEP = 100_000


def _lists(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _objects(depth: int) -> bytes:
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def _post_telemetry(tmp_path, bodies: list[bytes]) -> list:
    address = f"127.0.0.1:{free_port()}"  # nothing listens: /telemetry never reaches Temporal
    s = Settings(state_dir=tmp_path, temporal_address=address, api_keys=(KEY,))
    client = asyncio.run(Client.connect(address, lazy=True))
    headers = {"X-API-Key": KEY, "Content-Type": "application/json"}
    with TestClient(create_app(s, client=client)) as http:
        return [http.post("/api/v1/telemetry", content=body, headers=headers) for body in bodies]


def _refused_for_depth(answer) -> bool:
    return answer.status_code == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in answer.json()["detail"]


def test_telemetry_refuses_100k_deep_lists_and_objects_naming_the_limit(tmp_path):
    for answer in _post_telemetry(tmp_path, [_lists(DEEP), _objects(DEEP)]):
        assert _refused_for_depth(answer), answer.text


def test_a_normal_telemetry_body_and_one_at_the_limit_still_answer_200(tmp_path):
    event = GenericEvent(
        event="GENERIC_EVENT",
        event_id="e1",
        event_name="step",
        event_session_index=0,
        severity="INFO",
        timestamp=datetime.now(UTC),
        event_data={"loss": 0.5, "nested": {"list": [1, [2, [3]]]}},
    )
    sdk = TelemetrySendRequest(
        events=[event], platform="linux", sdk_version="0.38.0", session_id="s", process_uuid="p"
    ).model_dump_json()
    answers = _post_telemetry(tmp_path, [sdk.encode(), _lists(MAX_JSON_DEPTH), _objects(MAX_JSON_DEPTH)])
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    over = _post_telemetry(tmp_path, [_lists(MAX_JSON_DEPTH + 1), _objects(MAX_JSON_DEPTH + 1)])
    assert all(_refused_for_depth(a) for a in over)


def test_brackets_and_escaped_quotes_inside_strings_do_not_count(tmp_path):
    deep_text = "[{" * DEEP
    body = json.dumps({"s": deep_text, "t": '\\"' + deep_text, "u": ['"]', "\\", "[[["]}).encode()
    assert json_depth(body) == 2
    assert _post_telemetry(tmp_path, [body])[0].status_code == 200
    # An escaped quote does not end the string; an escaped backslash before a quote does not escape it.
    assert json_depth(rb'["\"[[[[", "\\", [[]]]') == 3
    assert json_depth(rb'["\\\"[[[" , [1]]') == 2
    # An unterminated string hides the rest, as it does from the parser (which stops there).
    assert json_depth(b'["abc\\", [[[[') == 1


def _echo_app(settings: Settings | None = None) -> TestClient:
    async def echo(request: Request) -> JSONResponse:
        raw = await request.body()
        is_json = request.headers.get("content-type") == "application/json"
        return JSONResponse({"bytes": len(raw), "depth": _true_depth(json.loads(raw)) if is_json else None})

    # As create_app places them: BodyLimit outermost, the depth check inside it, so what it reads is bounded.
    middleware = [Middleware(BodyLimit, settings=settings or Settings()), Middleware(JsonDepthLimit)]
    return TestClient(Starlette(routes=[Route("/api/v1/{name}", echo, methods=["POST"])], middleware=middleware))


def test_a_body_at_the_limit_reaches_the_route_intact_and_parses():
    client = _echo_app()
    for body in (_lists(MAX_JSON_DEPTH), _objects(MAX_JSON_DEPTH)):
        r = client.post("/api/v1/optim_step", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json() == {"bytes": len(body), "depth": MAX_JSON_DEPTH}
    # Streamed in pieces (no Content-Length): read whole, then handed on whole.
    pieces = [b"[" * 100, b"[" * 28 + b"]" * 28, b"]" * 100]
    r = client.post("/api/v1/optim_step", content=iter(pieces), headers={"Content-Type": "application/json"})
    assert r.json() == {"bytes": 256, "depth": MAX_JSON_DEPTH}


def test_a_streamed_deep_body_is_refused_and_one_over_the_size_limit_stays_a_413():
    client = _echo_app(Settings(max_request_bytes=10_000_000, max_sample_body_bytes=1_000))
    r = client.post("/api/v1/optim_step", content=iter([b"[" * DEEP, b"]" * DEEP]))
    assert _refused_for_depth(r)
    r = client.post("/api/v1/asample", content=_lists(DEEP))
    assert r.status_code == 413 and "--max-sample-body-bytes" in r.json()["detail"]


def test_protobuf_bodies_are_not_json_and_pass_untouched():
    client = _echo_app()
    body = b"\x0a\x03abc" + b"[{" * DEEP  # bytes a protobuf may well hold
    for kind in ("application/x-protobuf", "application/octet-stream"):
        r = client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": kind})
        assert r.status_code == 200 and r.json()["bytes"] == len(body)


def _true_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_true_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_true_depth(v) for v in value), default=0)
    return 0


# Text drawn from the characters that could fool a scan: brackets, quotes, backslashes, and non-ASCII.
_TEXT = st.text(alphabet=st.sampled_from('[]{}"\\,:ab é\n\u2028'), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]), block=st.integers(1, 7))
def test_the_scan_depth_equals_the_true_depth_of_any_json(value, ascii_only, indent, block):
    body = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert json_depth(body) == _true_depth(value)
    # The same across blocks cut anywhere: a string, an escape or a run of brackets split between two blocks.
    with mock.patch.object(depth_module, "_BLOCK", block):
        assert json_depth(body) == _true_depth(value)
