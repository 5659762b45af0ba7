"""What the fuzz tests share: valid request bodies to start from, mutations of them, and the invariant.

The invariant: every request gets a 4xx with a JSON body naming the problem, or a 2xx whose future
resolves within FUTURE_BOUND_S to an answer or a `user` error; never a 5xx, never a hang.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

FUTURE_BOUND_S = 180.0
# Far beyond the run's sequence window (workflows/training_run.py SEQ_WINDOW): refused at submit, never waited for.
FAR_SEQ = 10**9

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "*", "../..", "tinker://x/weights/y", "a" * 300, "\x00", "sess-x:train:0"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def mutated(draw, body: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """`body` with up to three mutations: a key dropped, a value replaced, an unknown key added; `keep` untouched."""
    out = dict(body)
    for _ in range(draw(st.integers(0, 3))):
        keys = [k for k in out if k not in keep]
        action = draw(st.sampled_from(["drop", "replace", "add", "nested"]))
        if action == "drop" and keys:
            out.pop(draw(st.sampled_from(keys)))
        elif action == "replace" and keys:
            out[draw(st.sampled_from(keys))] = draw(json_values)
        elif action == "nested" and keys:
            key = draw(st.sampled_from(keys))
            if isinstance(out[key], dict) and out[key]:
                inner = dict(out[key])
                inner[draw(st.sampled_from(sorted(inner)))] = draw(json_scalars)
                out[key] = inner
        else:
            out[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    return out


def sequence_mutations() -> st.SearchStrategy:
    """seq_id values that must never wait: invalid ones, and one far beyond the window."""
    return st.sampled_from([-1, "1", 1.5, True, [1], 2**70, FAR_SEQ])


def encode(body: dict[str, Any]) -> bytes:
    """JSON as a hostile client may send it: NaN and Infinity tokens included."""
    import json

    return json.dumps(body, allow_nan=True).encode()


@dataclass
class Wire:
    base_url: str
    api_key: str
    http: httpx.Client = field(init=False)
    requests: int = 0

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.base_url, headers={"X-API-Key": self.api_key}, timeout=120)

    def send(
        self, method: str, path: str, content: bytes | None = None, content_type: str = "application/json"
    ) -> httpx.Response:
        self.requests += 1
        r = self.http.request(method, path, content=content, headers={"Content-Type": content_type})
        check_status(r, f"{method} {path}")
        return r

    def post_json(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.send("POST", path, encode(body))

    def resolve(self, request_id: Any) -> dict[str, Any]:
        """Poll a future until it answers; it must answer within FUTURE_BOUND_S, as a result or a `user` error."""
        deadline = time.monotonic() + FUTURE_BOUND_S
        while True:
            r = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id})
            check_status(r, "retrieve_future")
            assert r.status_code == 200, (r.status_code, r.text[:300])
            if "protobuf" in r.headers.get("content-type", ""):
                return {"proto": r.content}
            answer = r.json()
            if answer.get("type") != "try_again":
                if "error" in answer:
                    assert answer.get("category") == "user", answer
                _no_non_finite_tokens(r.content)
                return answer
            assert time.monotonic() < deadline, f"future {request_id} not answered in {FUTURE_BOUND_S} s"

    def answer_of(self, r: httpx.Response) -> dict[str, Any] | None:
        """For a 2xx carrying a request_id: the future's answer. None for a 4xx."""
        if r.status_code >= 400:
            return None
        body = r.json()
        return self.resolve(body["request_id"]) if isinstance(body, dict) and "request_id" in body else body


def check_status(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        detail = r.json().get("detail")
        assert detail, f"{what}: {r.status_code} without a detail: {r.text[:300]}"


def _no_non_finite_tokens(content: bytes) -> None:
    import orjson  # what the SDK parses answers with: NaN/Infinity tokens would break it

    orjson.loads(content)


def finite(x: float) -> bool:
    return math.isfinite(x)
