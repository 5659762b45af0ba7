"""A bound on how deeply a JSON body nests, checked on the raw bytes before any parser sees them (pure ASGI).

Python's json, pydantic and the routes' own walks of a body recurse once per level: a body of 100,000 `[` was a
RecursionError on the routes that parse their body and a 200 on /telemetry, which never reads it. Every body but a
protobuf one is now read whole before the app runs (BodyLimit, outside this, still bounds its size and answers 413),
its depth counted in linear time (strings skipped, escapes included) and refused with a 400 naming MAX_JSON_DEPTH
when it nests deeper; the app then receives the same bytes. One place for every route, those that never read their
body included, so no route has to remember the check.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tinkerflow.api.body_limits import ASGIApp, Message, Scope, send_detail

# The tinker SDK's deepest bodies (a custom loss graph's encoded args, an OpenAI request's tool schema) nest about
# ten levels; 128 (serde_json's default) leaves tenfold room and stays far below Python's recursion limit of 1,000,
# which each level of parsing and of every walk after it spends a frame or more of.
MAX_JSON_DEPTH = 128

# Not JSON: forward_backward's protobuf (often zstd-compressed), whose bytes would count as brackets at random.
_NOT_JSON = frozenset({"application/x-protobuf", "application/protobuf", "application/octet-stream"})

_STEP = np.zeros(256, np.int8)  # what each byte does to the depth, were it outside a string
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_BLOCK = 1 << 22  # bytes per pass: a few int32 arrays of 16 MiB at most, whatever the body's size


def json_depth(body: bytes) -> int:
    """How deeply `body` nests as JSON: a scalar 0, `[]` 1, `{"a": [1]}` 2; brackets inside strings do not count.

    Vectorised (numpy), as fast for a body of a million short strings as for one of a million numbers, where a
    per-token loop or regex would take seconds of the event loop for a 16 MiB body. Exact for a body a parser
    accepts; for another, exact up to where a parser stops (an unterminated string hides what follows it, as it
    does from the parser; a closing bracket with nothing open lowers the count, but the parser refuses it first)."""
    if b"\\" in body:
        # A run of backslashes keeps only its parity (each \\ pair goes, left to right), then each escaped quote
        # goes: a quote is left only where a string opens or closes, and no bracket is removed.
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(body, np.uint8)
    deepest = depth = inside = 0
    for start in range(0, len(data), _BLOCK):
        block = data[start : start + _BLOCK]
        # A byte is inside a string when an odd number of quotes come before it (with the blocks before).
        quotes = np.cumsum(block == ord('"'), dtype=np.int32) + inside
        levels = np.cumsum(np.where(quotes & 1, 0, _STEP[block]), dtype=np.int32)
        deepest = max(deepest, depth + int(levels.max()))
        depth, inside = depth + int(levels[-1]), int(quotes[-1]) & 1
    return deepest


def _media_type(scope: Scope) -> str:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return ""


class JsonDepthLimit:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or _media_type(scope) in _NOT_JSON:
            await self.app(scope, receive, send)
            return
        # Read whole: a route may answer without reading its body (/telemetry), and the scan must see all of it.
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        if message["type"] == "http.request":  # else the client left: the app gets the disconnect, as it would have
            body = b"".join(m.get("body", b"") for m in messages)
            # No more openers than the limit cannot nest past it: a count in C spares most bodies the scan.
            if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
                detail = f"JSON body nested deeper than {MAX_JSON_DEPTH} levels (the limit); flatten it"
                await send_detail(send, 400, detail)
                return
            messages = [{"type": "http.request", "body": body, "more_body": False}]
        pending = deque(messages)

        async def replayed_receive() -> Message:
            # Then the real receive: a streaming answer listens on it for the client's disconnect.
            return pending.popleft() if pending else await receive()

        await self.app(scope, replayed_receive, send)
