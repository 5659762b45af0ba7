"""Names, ids and paths from a stranger: hypothesis sends lengths, unicode, separators, dots, globs and
percent-encodings to every route that takes one. Never a 5xx, never a reset connection; an in-sequence op
(save_state with a bad name) still answers a request_id whose future fails with category `user`.

On the session's shared stack; a bounded number of examples per route keeps the default run to a minute or two.
"""

from __future__ import annotations

import itertools
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import API_KEY

pytestmark = pytest.mark.e2e
EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# What a stranger types: anything, plus the shapes that have hurt (long names, dots, separators, encodings, globs).
ODD = st.sampled_from(
    [
        "",
        ".",
        "..",
        "...",
        "a" * 40,
        "a" * 41,
        "a" * 129,
        "a" * 300,
        "é",
        "名前",
        "😀" * 30,
        "a/b",
        "../x",
        "..%2F..",
        "%2e%2e",
        "%2F",
        "%00",
        "a\x00b",
        "a\nb",
        "*",
        "**",
        "?",
        "[a]",
        "a b",
        "'",
        '"',
        "a' OR '1'='1",
        "\\",
        "~",
        "a:b",
        "a:train:0",
        "x" * 50 + ":train:0",
        "tinker://",
        "tinker://x/weights/y",
        "sess-000000000000",
    ]
)
NAMES = st.one_of(ODD, st.text(max_size=300), st.text(alphabet="ab.:/%*?-_ é\\", max_size=60))


@pytest.fixture(scope="module")
def api(stack):
    client = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": API_KEY}, timeout=120)
    model = stack.served_model()
    session = client.post(
        "/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    ).json()["session_id"]
    created = client.post(
        "/api/v1/create_model",
        json={"session_id": session, "model_seq_id": 0, "base_model": model, "lora_config": {"rank": 2}},
    )
    assert created.status_code == 200, created.text
    yield {"client": client, "session": session, "run": created.json()["model_id"], "seq": itertools.count(1)}
    client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}})  # frees its slot
    client.close()


def _ok(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.request.method, str(r.request.url)[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:  # an error carries a JSON body (the SDK retries an empty 400); 3xx: slash redirects
        assert r.headers.get("content-type", "").startswith("application/json"), r.text[:200]


def _segments(x: str) -> list[str]:
    """As a path segment: fully percent-encoded, and with separators, dots and '%' left raw."""
    return [quote(x, safe=""), quote(x, safe="/%.:*")]


@EXAMPLES
@given(x=NAMES)
def test_path_parameters(api, x):
    c, run, session = api["client"], api["run"], api["session"]
    for seg in _segments(x):
        for path in (
            f"/api/v1/training_runs/{seg}",
            f"/api/v1/training_runs/{seg}/checkpoints",
            f"/api/v1/sessions/{seg}",
            f"/api/v1/sessions/{seg}/trace_export",
            f"/api/v1/samplers/{seg}",
            f"/api/v1/training_runs/{run}/checkpoints/weights/{seg}/external_weights_urls",
            f"/api/v1/training_runs/{seg}/checkpoints/weights/a/external_weights_urls",
            f"/api/v1/checkpoint_files/{seg}/weights/{seg}/{seg}?expires=1&signature=x",
        ):
            _ok(c.get(path))
        for path in (
            f"/api/v1/training_runs/{run}/checkpoints/weights/{seg}",
            f"/api/v1/training_runs/{seg}/checkpoints/sampler_weights/a",
            f"/api/v1/training_runs/{run}/checkpoints/{seg}",
        ):
            _ok(c.delete(path))
            _ok(c.post(f"{path}/publish"))
            _ok(c.put(f"{path}/ttl", json={"ttl_seconds": 3600}))
        _ok(c.post(f"/api/v1/sessions/{seg}/finish", json={"reason": {"type": "success"}}))
        _ok(c.put(f"/api/v1/sessions/{seg}/project", json={"project_id": "p"}))
    _ok(c.put(f"/api/v1/sessions/{session}/project", json={"project_id": x}))


@EXAMPLES
@given(x=NAMES)
def test_body_ids_and_paths(api, x):
    c, run, session = api["client"], api["run"], api["session"]
    for path in (x, f"tinker://{x}", f"tinker://{run}/weights/{x}", f"tinker://{x}/weights/a", f"tinker://{run}/{x}/a"):
        _ok(c.post("/api/v1/weights_info", json={"tinker_path": path}))
        _ok(c.post("/api/v1/copy_weights", json={"source_path": path}))
        _ok(
            c.post(
                "/api/v1/create_sampling_session",
                json={"session_id": session, "sampling_session_seq_id": 99, "model_path": path},
            )
        )
        r = c.post("/api/v1/load_weights", json={"session_id": session, "model_seq_id": 99, "path": path})
        _ok(r)
    _ok(c.post("/api/v1/session_heartbeat", json={"session_id": x}))
    _ok(c.post("/api/v1/sessions/search", json={"session_id": x}))
    _ok(c.post("/api/v1/retrieve_future", json={"request_id": x}))
    _ok(c.post("/api/v1/get_info", json={"model_id": x}))
    _ok(c.post("/api/v1/optim_step", json={"model_id": x, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}))
    _ok(c.post("/api/v1/create_model", json={"session_id": x, "model_seq_id": 3, "base_model": "m"}))
    _ok(
        c.post(
            "/api/v1/copy_weights",
            json={"source_path": f"tinker://{run}/weights/a", "session_id": x, "model_seq_id": 1},
        )
    )


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(x=NAMES)
def test_in_sequence_saves_fail_their_future_as_user_errors(api, x):
    """An op with a seq_id never fails at submit: a bad name consumes its seq_id and fails its own future."""
    c, run = api["client"], api["run"]
    seq = next(api["seq"])
    r = c.post("/api/v1/save_weights", json={"model_id": run, "seq_id": seq, "path": x})
    _ok(r)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    for _ in range(20):
        out = c.post("/api/v1/retrieve_future", json={"request_id": rid})
        _ok(out)
        if out.json().get("type") != "try_again":
            break
    body = out.json()
    if "error" in body:
        assert body["category"] == "user", body
    else:  # a valid name: saved
        assert body["path"] == f"tinker://{run}/weights/{x}"


@pytest.mark.parametrize("name", ["a" * 40, "a" * 41, "a" * 129, "a" * 300, "é", "名前", "a.b", "..", "%2e%2e"])
def test_the_names_of_issue_13(api, name):
    """The reported cases: weights_info of tinker:// + 50 characters (was 500), 40/41-letter and non-ASCII names on
    DELETE (was 500 / a reset connection), a 300-character save_state name (was a `server` failure)."""
    c, run = api["client"], api["run"]
    _ok(c.post("/api/v1/weights_info", json={"tinker_path": "tinker://" + "a" * 50}))
    for seg in _segments(name):
        r = c.delete(f"/api/v1/training_runs/{run}/checkpoints/weights/{seg}")
        _ok(r)
        assert r.status_code in (400, 404, 405), r.text  # 405: the client resolved ".." in the URL
    _ok(c.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{run}/weights/{name}"}))
