"""A fuzzed wire: valid SDK requests for every route, mutated (JSON and protobuf bodies, headers, path
parameters), sent to the running stack. Each must get a 4xx with a body, or a future that resolves to an answer or a
`user` error within a bound; never a 5xx, never a hang; afterwards the same TrainingClient trains on and the API's
memory has stayed bounded. The fuzzer owns one run's seq_ids, so it knows which op is next and never leaves a gap.

The long run draws more examples per test: `TINKERFLOW_FUZZ=long bash scripts/test.sh tests/fuzz`
(`TINKERFLOW_FUZZ_EXAMPLES` sets the count).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from tests.e2e.test_bad_input import _still_trains
from tests.fuzz.wire import FAR_SEQ, Wire, json_values, mutated, sequence_mutations
from tinkerflow.api.protobuf_header import read_forward_backward_header

pytestmark = pytest.mark.e2e


class FuzzRun:
    """A training run made over raw HTTP in the SDK client's session: the fuzzer's own sequence."""

    def __init__(self, wire: Wire, session_id: str, base_model: str) -> None:
        self.wire, self.session_id, self.base_model = wire, session_id, base_model
        r = wire.post_json(
            "/api/v1/create_model",
            {"session_id": session_id, "model_seq_id": 7000, "base_model": base_model, "lora_config": {"rank": 4}},
        )
        self.model_id = r.json()["model_id"]
        assert "error" not in wire.answer_of(r)  # pyright: ignore[reportOperatorIssue] (a None fails the test)
        self.next_seq = 1
        r = wire.post_json(
            "/api/v1/create_sampling_session",
            {"session_id": session_id, "sampling_session_seq_id": 7000, "base_model": base_model},
        )
        self.sampler_id = r.json()["sampling_session_id"]

    def sequenced(self, path: str, body: dict) -> None:
        """Send an in-sequence op; a 2xx consumed the seq_id (and its future must resolve), a 4xx did not."""
        r = self.wire.post_json(path, body)
        if r.status_code < 400:
            assert body.get("seq_id") == self.next_seq and body.get("model_id") == self.model_id, body
            self.next_seq += 1
            self.wire.answer_of(r)


@pytest.fixture(scope="module")
def wire(stack) -> Wire:
    return Wire(stack.base_url, stack.api_key)


@pytest.fixture(scope="module")
def fuzz_run(wire, training_client, base_model) -> FuzzRun:
    return FuzzRun(wire, training_client.model_id.split(":")[0], base_model)


def _api_rss_kb(stack) -> int:
    """Resident memory of the API process (uvicorn under `tinkerflow up`), from /proc."""
    import subprocess

    out = subprocess.run(
        ["pgrep", "-P", str(stack.proc.pid), "-f", "tinkerflow.cli.main api"], capture_output=True, text=True
    ).stdout.split()
    if not out:
        return 0
    for line in Path(f"/proc/{out[0]}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@st.composite
def sequenced_json(draw, run: FuzzRun) -> tuple[str, dict]:
    """A mutated in-sequence JSON op: the sequence key kept right, or made invalid (never a gap)."""
    path, body = draw(
        st.sampled_from(
            [
                ("/api/v1/optim_step", {"type": "optim_step", "adam_params": dict(ADAM)}),
                ("/api/v1/save_weights", {"type": "save_weights", "path": "fz"}),
                (
                    "/api/v1/save_weights_for_sampler",
                    {"type": "save_weights_for_sampler", "sampling_session_seq_id": 8000},
                ),
                ("/api/v1/save_weights_external", {"type": "save_weights_external", "path": "fx"}),
                ("/api/v1/load_weights", {"type": "load_weights", "path": "tinker://x/weights/y", "optimizer": True}),
            ]
        )
    )
    body = draw(mutated({**body, "model_id": run.model_id, "seq_id": run.next_seq}, keep=("model_id", "seq_id")))
    if draw(st.integers(0, 5)) == 0:
        body["seq_id"] = draw(sequence_mutations())
    return path, body


def test_in_sequence_json_ops_never_wedge_the_run(wire, fuzz_run, training_client):
    @given(data=st.data())
    def run(data):
        path, body = data.draw(sequenced_json(fuzz_run))
        fuzz_run.sequenced(path, body)

    run()
    # The run's next seq_id still runs, and the SDK's own client trains on.
    fuzz_run.sequenced(
        "/api/v1/optim_step",
        {"model_id": fuzz_run.model_id, "seq_id": fuzz_run.next_seq, "type": "optim_step", "adam_params": ADAM},
    )
    _still_trains(training_client)


def _fwd_request(run: FuzzRun, seq_id: int, tokens: list[int]) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id=run.model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for key, values, dtype, code in (
        ("target_tokens", tokens[1:] + tokens[:1], np.int64, pb.DTYPE_INT64),
        ("weights", [1.0] * len(tokens), np.float32, pb.DTYPE_FLOAT32),
    ):
        t = d.loss_fn_inputs[key]
        t.dtype = code
        t.shape.append(len(tokens))
        t.dense = np.asarray(values, dtype).tobytes()
    return msg


@st.composite
def fwd_bodies(draw, run: FuzzRun) -> bytes:
    msg = _fwd_request(run, run.next_seq, draw(st.lists(st.integers(-5, 2**31 - 1), min_size=1, max_size=8)))
    d = msg.data[0]
    field_mutation = draw(st.sampled_from(["none", "shape", "sparse", "dtype", "loss", "tokens", "config"]))
    t = d.loss_fn_inputs[draw(st.sampled_from(["target_tokens", "weights"]))]
    if field_mutation == "shape":
        del t.shape[:]
        t.shape.extend(draw(st.lists(st.integers(-3, 2**40), max_size=3)))
    elif field_mutation == "sparse":
        n = draw(st.integers(0, 2**40))
        t.sparse_csr.crow_indices = np.asarray(draw(st.lists(st.integers(-2, 10), max_size=6)), np.int64).tobytes()
        t.sparse_csr.col_indices = np.asarray(draw(st.lists(st.integers(-2, 10), max_size=6)), np.int64).tobytes()
        t.sparse_csr.values = draw(st.binary(max_size=48))
        del t.shape[:]
        t.shape.extend([draw(st.integers(0, 2**40)), n])
    elif field_mutation == "dtype":
        t.dtype = draw(st.integers(0, 9))
    elif field_mutation == "loss":
        msg.loss_fn = draw(st.sampled_from(["", "ppo", "importance_sampling", "cispo", "dro", "nope", "a" * 300]))
    elif field_mutation == "tokens":
        d.model_input[0].encoded_text.tokens = draw(st.binary(max_size=64))
    elif field_mutation == "config":
        msg.loss_fn_config[draw(st.text(max_size=10))] = draw(st.floats(allow_nan=True, allow_infinity=True))
    body = msg.SerializeToString()
    if draw(st.integers(0, 4)) == 0:  # byte-level: flip, cut or extend
        raw = bytearray(body)
        # Drawn independently of the body's length (which depends on the run's seq_id): hypothesis needs the
        # same draws to replay an example.
        at = draw(st.integers(0, 1 << 16)) % max(1, len(raw))
        how = draw(st.sampled_from(["flip", "cut", "extend"]))
        if how == "flip" and raw:
            raw[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            raw = raw[:at]
        else:
            raw += draw(st.binary(min_size=1, max_size=32))
        body = bytes(raw)
    return body


def _sequence_of(body: bytes) -> tuple[str, int] | None:
    """The run and place in its sequence the API routes a body to: it reads only the top-level fields, so a body
    whose datums do not decode is still in sequence (and fails through its future, never at submit)."""
    try:
        header = read_forward_backward_header(body)
    except ValueError:
        return None
    return header.model_id, header.seq_id


def test_protobuf_forward_backward_bodies_never_wedge_the_run(wire, fuzz_run, training_client):
    from hypothesis import assume

    @given(data=st.data())
    def run(data):
        body = data.draw(fwd_bodies(fuzz_run))
        key = _sequence_of(body)
        # A byte flip that moved the seq_id into the window ahead would make an op wait for its gap (by design):
        # the fuzzer's own sequence would then be wrong, not the server.
        assume(
            key is None
            or key == (fuzz_run.model_id, fuzz_run.next_seq)
            or key[0] != fuzz_run.model_id
            or key[1] < fuzz_run.next_seq
            or key[1] > fuzz_run.next_seq + 10_000
        )
        encoding = data.draw(st.sampled_from(["", "zstd-bogus"]))
        headers = {"Content-Type": "application/x-protobuf"}
        if encoding:
            headers["Content-Encoding"] = "zstd"
        r = wire.http.post("/api/v1/forward_backward", content=body, headers=headers)
        wire.requests += 1
        from tests.fuzz.wire import check_status

        check_status(r, "forward_backward")
        if r.status_code < 400:
            assert key == (fuzz_run.model_id, fuzz_run.next_seq)
            fuzz_run.next_seq += 1
            wire.answer_of(r)

    run()
    ok = _fwd_request(fuzz_run, fuzz_run.next_seq, [10, 20, 30, 40])
    r = wire.send("POST", "/api/v1/forward_backward", ok.SerializeToString(), "application/x-protobuf")
    fuzz_run.next_seq += 1
    assert "proto" in wire.answer_of(r)
    _still_trains(training_client)


@st.composite
def other_requests(draw, run: FuzzRun) -> tuple[str, str, dict | None]:
    """Every route outside a run's sequence, with mutated bodies and path parameters."""
    run_id, sess = run.model_id, run.session_id
    segment = draw(st.sampled_from([run_id, "*", "..", "%2e%2e", "a" * 300, "sess-x:train:0", "x/y"]))
    name = draw(st.sampled_from(["weights/fz", "sampler_weights/x", "*", "../../etc", "weights/" + "n" * 300]))
    choices = [
        ("POST", "/api/v1/create_session", {"tags": ["fz"], "user_metadata": {"a": "b"}, "sdk_version": "0.38.0"}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": sess}),
        (
            "POST",
            "/api/v1/create_model",
            {"session_id": sess, "model_seq_id": 9000, "base_model": run.base_model, "lora_config": {"rank": 4}},
        ),
        ("POST", "/api/v1/get_info", {"model_id": run_id}),
        (
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": sess, "sampling_session_seq_id": 9001, "base_model": run.base_model},
        ),
        (
            "POST",
            "/api/v1/asample",
            {
                "sampling_session_id": run.sampler_id,
                "seq_id": 1,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2, "temperature": 1.0},
            },
        ),
        ("POST", "/api/v1/retrieve_future", {"request_id": "x"}),
        ("POST", "/api/v1/weights_info", {"tinker_path": f"tinker://{run_id}/weights/fz"}),
        ("POST", "/api/v1/sessions/search", {"limit": 5}),
        ("POST", "/api/v1/load_weights", {"session_id": sess, "model_seq_id": 9002, "path": "tinker://a/weights/b"}),
        ("GET", f"/api/v1/training_runs/{segment}", None),
        ("GET", f"/api/v1/training_runs/{segment}/checkpoints", None),
        ("PUT", f"/api/v1/training_runs/{segment}/checkpoints/{name}/ttl", {"ttl_seconds": 7200}),
        ("POST", f"/api/v1/training_runs/{segment}/checkpoints/{name}/publish", {}),
        ("GET", f"/api/v1/samplers/{draw(st.sampled_from([run.sampler_id, '*', 'x' * 300]))}", None),
        ("GET", f"/api/v1/sessions/{draw(st.sampled_from([sess, '*', '..']))}", None),
        ("GET", "/api/v1/training_runs?limit=" + draw(st.sampled_from(["5", "-1", "abc", "1e300", "99999999"])), None),
    ]
    method, path, body = draw(st.sampled_from(choices))
    if body is not None:
        body = draw(mutated(body))
    return method, path, body


def test_every_other_route_answers_4xx_or_resolves(wire, fuzz_run, training_client, stack):
    before = _api_rss_kb(stack)
    assert before, "the API process was not found"

    @given(data=st.data(), garbage=json_values)
    def run(data, garbage):
        method, path, body = data.draw(other_requests(fuzz_run))
        how = data.draw(st.sampled_from(["json", "json", "json", "not-json", "wrong-type"]))
        if body is None:
            content = None
        elif how == "not-json":
            content = zlib.compress(repr(garbage).encode())
        elif how == "wrong-type":
            from tests.fuzz.wire import encode

            content = encode({"x": garbage}) if not isinstance(garbage, dict) else b"[1, 2]"
        else:
            from tests.fuzz.wire import encode

            content = encode(body)
        r = wire.send(method, path, content)
        wire.answer_of(r)

    run()
    _still_trains(training_client)
    after = _api_rss_kb(stack)
    # Bounded: nothing the fuzzer sent is kept (a leak per request would show as tens of MB here).
    assert after - before < 200_000, (before, after)


def test_far_seq_id_is_refused_and_the_run_goes_on(wire, fuzz_run):
    """A named regression of the fuzzed wire: a seq_id beyond the window is answered at once, not waited for."""
    r = wire.post_json(
        "/api/v1/optim_step",
        {"model_id": fuzz_run.model_id, "seq_id": FAR_SEQ, "type": "optim_step", "adam_params": ADAM},
    )
    assert r.status_code == 400
    fuzz_run.sequenced(
        "/api/v1/optim_step",
        {"model_id": fuzz_run.model_id, "seq_id": fuzz_run.next_seq, "type": "optim_step", "adam_params": ADAM},
    )


@pytest.mark.slow
def test_too_many_datums_fail_through_the_future_and_the_run_goes_on(wire, fuzz_run):
    """The per-request datum cap is in sequence: the seq_id is consumed and its future says which flag to raise."""
    msg = _fwd_request(fuzz_run, fuzz_run.next_seq, [10, 20, 30])
    for _ in range(4096):  # --max-datums-per-request defaults to 4096
        msg.data.add().CopyFrom(msg.data[0])
    r = wire.send("POST", "/api/v1/forward_backward", msg.SerializeToString(), "application/x-protobuf")
    assert r.status_code == 200
    fuzz_run.next_seq += 1
    answer = wire.answer_of(r)
    assert answer["category"] == "user" and "--max-datums-per-request" in answer["error"]
    fuzz_run.sequenced(
        "/api/v1/optim_step",
        {"model_id": fuzz_run.model_id, "seq_id": fuzz_run.next_seq, "type": "optim_step", "adam_params": ADAM},
    )
