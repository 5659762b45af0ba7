# pyright: reportOptionalSubscript=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""The checks behind "nothing wedges", without a stack: hyper-parameter ranges, metadata bounds, how
non-finite numbers travel, ttl values, sparse shapes and per-route body limits."""

from __future__ import annotations

import json
import math

import numpy as np
import orjson
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb
from tinker.types import AdamParams, OptimStepRequest, OptimStepResponse

from tinkerflow.activities.wire import Bounds, forward_backward_input
from tinkerflow.api.body_limits import BodyLimit
from tinkerflow.api.json_wire import WireJSONResponse, finite_json
from tinkerflow.api.op_checks import MAX_USER_METADATA_BYTES, adam_problem, metadata_problem, parse, sequence_key
from tinkerflow.common.checkpoints import CheckpointError, check_ttl
from tinkerflow.common.settings import Settings
from tinkerflow.workers.engine.types import InputError


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"learning_rate": math.inf}, "learning_rate"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"weight_decay": -1e6}, "weight_decay"),
        ({"grad_clip_norm": -1.0}, "grad_clip_norm"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"eps": -1e-8}, "eps"),
        ({"eps": math.nan}, "eps"),
    ],
)
def test_adam_params_outside_torch_adamw_ranges_are_named(changes, field):
    assert field in adam_problem(AdamParams(**changes))


def test_good_adam_params_pass():
    assert adam_problem(AdamParams()) == ""
    assert adam_problem(AdamParams(learning_rate=0.0, beta1=0.0, beta2=0.0, eps=0.0, grad_clip_norm=1.0)) == ""


def test_an_sdk_nan_learning_rate_is_a_message_naming_the_field_not_an_exception():
    # The SDK serialises NaN as null: the body the server sees.
    wire = json.loads(
        OptimStepRequest(optim_params=AdamParams(learning_rate=math.nan), model_id="m", seq_id=3).model_dump_json()
    )
    assert wire["adam_params"]["learning_rate"] is None
    assert sequence_key(wire, "optim_step") == ("m", 3)
    req, problem = parse(OptimStepRequest, wire, "optim_step")
    assert req is None and "learning_rate" in problem and "null" in problem


@pytest.mark.parametrize(
    "raw",
    [
        {"seq_id": 1},
        {"model_id": "", "seq_id": 1},
        {"model_id": "m", "seq_id": -1},
        {"model_id": "m", "seq_id": "1"},
        {"model_id": "m", "seq_id": True},
    ],
)
def test_without_a_sequence_key_there_is_nothing_to_admit(raw):
    with pytest.raises(Exception) as e:
        sequence_key(raw, "optim_step")
    assert getattr(e.value, "status_code", None) == 400


def test_user_metadata_is_bounded():
    assert metadata_problem(None) == "" and metadata_problem({"a": "b"}) == ""
    assert "over the limit" in metadata_problem({"k": "x" * MAX_USER_METADATA_BYTES})
    assert "JSON object" in metadata_problem(["x"])


def test_non_finite_results_travel_as_strings_the_sdk_reads_back():
    content = {"metrics": {"grad_norm": math.nan, "a": math.inf, "b": -math.inf, "c": 1.5}, "type": "optim_step"}
    body = WireJSONResponse(content).body
    parsed = orjson.loads(body)  # the SDK 0.38 parses answers with orjson: no NaN tokens allowed
    metrics = OptimStepResponse.model_validate(parsed).metrics
    assert math.isnan(metrics["grad_norm"]) and metrics["a"] == math.inf and metrics["b"] == -math.inf
    assert metrics["c"] == 1.5
    assert finite_json([1, (2.0, math.nan)]) == [1, [2.0, "NaN"]]


@pytest.mark.parametrize("bad", ["abc", 1e300, math.inf, math.nan, 3600.5, True, [1], 10])
def test_ttl_must_be_a_whole_number_in_range(bad):
    with pytest.raises(CheckpointError, match="ttl_seconds"):
        check_ttl(bad)


def test_ttl_in_range_passes():
    check_ttl(None)
    check_ttl(7200)
    check_ttl(7200.0)


def _sparse_request(shape, crow, col, values) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(4, dtype=np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype = pb.DTYPE_INT64
    t.shape.extend(shape)
    t.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    t.sparse_csr.col_indices = np.asarray(col, np.int64).tobytes()
    t.sparse_csr.values = np.asarray(values, np.int64).tobytes()
    return msg


def test_a_huge_sparse_shape_is_an_input_error_before_any_allocation():
    msg = _sparse_request([4, 2**40], [0, 1, 1, 1, 1], [0], [7])
    with pytest.raises(InputError, match="beyond this model's context"):
        forward_backward_input(msg, 0, Bounds(max_rows=64, max_cols=1000))


@pytest.mark.parametrize("crow, col", [([0, 1, 1], [0]), ([0, 1, 1, 1, 1], [-1]), ([0, 1, 1, 1, 1], [5])])
def test_sparse_indices_that_do_not_fit_the_shape_are_input_errors(crow, col):
    with pytest.raises(InputError, match="do not fit"):
        forward_backward_input(_sparse_request([4, 5], crow, col, [7]), 0, Bounds(max_rows=64, max_cols=1000))


def test_a_sparse_tensor_in_bounds_densifies():
    inp = forward_backward_input(_sparse_request([4, 2], [0, 1, 1, 2, 2], [1, 0], [7, 9]), 0, Bounds(64, 1000))
    assert inp.data[0].inputs["target_tokens"].tolist() == [[0, 7], [0, 0], [9, 0], [0, 0]]


def _limited_app(settings: Settings) -> TestClient:
    seen: list[int] = []

    async def echo(request: Request) -> JSONResponse:
        seen.append(len(await request.body()))
        return JSONResponse({"read": seen[-1]})

    # Placed as create_app places it: a user middleware, inside Starlette's error middleware.
    class Observe(BaseHTTPMiddleware):  # like the app's metrics middleware, which runs the app in a task group
        async def dispatch(self, request, call_next):
            return await call_next(request)

    app = Starlette(
        routes=[Route("/api/v1/{name}", echo, methods=["POST"])],
        middleware=[Middleware(BodyLimit, settings=settings), Middleware(Observe)],
    )
    return TestClient(app)


def test_each_route_has_its_own_body_limit_enforced_before_reading():
    settings = Settings(max_request_bytes=10_000, max_sample_body_bytes=1_000, max_control_body_bytes=100)
    client = _limited_app(settings)
    assert client.post("/api/v1/forward_backward", content=b"x" * 5_000).status_code == 200
    r = client.post("/api/v1/forward_backward", content=b"x" * 20_000)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["detail"]
    assert client.post("/api/v1/asample", content=b"x" * 500).status_code == 200
    assert client.post("/api/v1/asample", content=b"x" * 5_000).status_code == 413
    r = client.post("/api/v1/create_session", content=b"x" * 500)
    assert r.status_code == 413 and "--max-control-body-bytes" in r.json()["detail"]
    # A streamed body with no declared length is counted as it arrives.
    r = client.post("/api/v1/create_session", content=iter([b"x" * 60, b"x" * 60]))
    assert r.status_code == 413
    assert client.post("/api/v1/create_session", content=iter([b"x" * 40, b"x" * 40])).status_code == 200


def test_fuzz_regression_a_300_character_run_id_in_a_checkpoint_route_is_a_user_error():
    """Found by tests/fuzz: PUT /training_runs/<300 chars>/checkpoints/weights/fz/ttl answered 500 (the store's
    "File name too long")."""
    from tinkerflow.common.checkpoints import TinkerPath

    with pytest.raises(CheckpointError, match="at most"):
        TinkerPath.from_checkpoint_id("a" * 300, "weights/fz")
    with pytest.raises(CheckpointError, match="at most"):
        TinkerPath.parse(f"tinker://run/weights/{'n' * 300}")
