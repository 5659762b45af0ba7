# pyright: reportOptionalIterable=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""Our encoders against the SDK's own decoders, and the SDK's own encoder against our decoder."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from tinkerflow.activities import wire
from tinkerflow.workers.engine.types import ForwardBackwardResult, InputError, SampledSequence, SampleResult


def _request(data, loss_fn="cross_entropy", config=None) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),  # pyright: ignore[reportArgumentType]
        model_id="s:train:0",
        seq_id=3,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def test_forward_backward_request_decodes_tokens_inputs_and_config():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs=dict(target_tokens=[6, 7, 8], weights=[0.0, 1.0, 0.5]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    msg = wire.parse_forward_backward(_request([datum], "ppo", {"clip_low_threshold": 0.7, "mode": "x"}))
    inp = wire.forward_backward_input(msg, slot=2)
    assert inp.slot == 2 and inp.loss_fn == "ppo" and not inp.forward_only
    assert inp.data[0].tokens.tolist() == [5, 6, 7] and inp.data[0].tokens.dtype == np.int32
    assert inp.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    np.testing.assert_array_equal(inp.data[0].inputs["weights"], np.array([0.0, 1.0, 0.5], np.float32))
    assert inp.loss_fn_config == {"clip_low_threshold": 0.7, "mode": "x"}


def test_sparse_csr_inputs_are_densified():
    targets = types.TensorData(
        data=[3, 9], dtype="int64", shape=[2, 3], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[0, 2]
    )
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": targets})
    inp = wire.forward_backward_input(wire.parse_forward_backward(_request([datum])), slot=0)
    assert inp.data[0].inputs["target_tokens"].tolist() == [[3, 0, 0], [0, 0, 9]]


def test_forward_backward_output_roundtrips_through_the_sdk_decoder():
    outputs = [
        {"logprobs": np.array([-1.0, -2.0], np.float32), "elementwise_loss": np.array([1.0, 2.0], np.float32)},
        {"logprobs": np.array([-0.5], np.float32), "elementwise_loss": np.array([0.5], np.float32)},
    ]
    decoded = deserialize_forward_backward_output(
        wire.forward_backward_output(ForwardBackwardResult(outputs=outputs, metrics={"loss:sum": 3.5}))
    )
    assert decoded.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert decoded.loss_fn_outputs[1]["elementwise_loss"].tolist() == [0.5]


def test_sample_output_roundtrips_through_the_sdk_decoder():
    result = SampleResult(
        sequences=[SampledSequence([4, 5], [-0.25, -0.5], "stop"), SampledSequence([6], [-1.0], "length")],
        prompt_logprobs=[None, -2.0],
    )
    decoded = deserialize_sample_response(wire.sample_output(result))
    assert [s.tokens for s in decoded.sequences] == [[4, 5], [6]]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.sequences[0].logprobs == [-0.25, -0.5]
    assert decoded.prompt_logprobs == [None, -2.0]


@pytest.mark.parametrize(
    "stop,ids,strings",
    [(None, None, []), ([], [], []), ("\n", None, ["\n"]), (["a", "b"], None, ["a", "b"]), ([7, 8], [7, 8], [])],
)
def test_sample_request_stop_forms(stop, ids, strings):
    """Strings keep the EOS stop (ids None), [] stops at nothing, ids add EOS in the engine (sample_requests)."""
    body = {
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 5, "temperature": 0.0, "top_k": -1, "top_p": 1.0, "stop": stop},
        "sampling_session_id": "s:sample:0",
        "seq_id": 0,
        "type": "sample",
    }
    inp = wire.sample_input(json.dumps(body).encode(), snapshot="s:sample:0")
    assert inp.stop_token_ids == ids and inp.stop_strings == strings
    assert inp.num_samples == 2 and inp.max_tokens == 5 and inp.snapshot == "s:sample:0"


def test_image_chunks_are_a_user_error():
    msg = wire.parse_forward_backward(
        _request(
            [
                types.Datum(
                    model_input=types.ModelInput(
                        chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
                    ),
                    loss_fn_inputs=dict(target_tokens=[1, 2, 3, 4]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
                )
            ]
        )
    )
    with pytest.raises(InputError, match="image chunks are not supported"):
        wire.forward_backward_input(msg, slot=0)


# Keys the cookbook 0.6.1 loops write into the same dict they merge optim_step metrics into
# (supervised.train, rl.train, recipes.rl_loop, distillation.sdft): none of ours may be among them.
COOKBOOK_STEP_KEYS = {"step", "learning_rate", "progress", "optim/lr", "optim/entropy", "time/total"}


def test_optim_step_metrics_cannot_overwrite_the_cookbooks_keys():
    out = wire.optim_step_metrics({"grad_norm": 1.5, "learning_rate": 1e-4, "step": 7})
    assert out == {"tinkerflow/grad_norm": 1.5, "tinkerflow/learning_rate": 1e-4, "tinkerflow/adapter_optim_steps": 7.0}
    assert not set(out) & COOKBOOK_STEP_KEYS
    assert all(k.startswith(wire.OPTIM_METRICS_PREFIX) for k in out)


def test_provenance_spans_become_the_sampled_target_positions():
    # As recipes.rl_loop builds it: a 3-token prompt and 4 sampled tokens; targets are shifted by one.
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 10, 11, 12]),
        loss_fn_inputs=dict(
            target_tokens=[2, 3, 10, 11, 12, 13],
            logprobs=[0.0] * 6,  # pyright: ignore[reportArgumentType] (Datum converts lists)
            advantages=[0, 0, 1, 1, 1, 1],
        ),
    )
    datum = datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="q", length=3),
            types.SampledProvenanceSpan(sequence_id="q", length=3),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="q", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="q", length=4),
        ],
    )
    inp = wire.forward_backward_input(wire.parse_forward_backward(_request([datum], "stable_reinforce")), slot=0)
    assert inp.data[0].sampled_mask.tolist() == [0, 0, 1, 1, 1, 1]
    plain = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs=dict(target_tokens=[2, 3]))  # pyright: ignore[reportArgumentType] (Datum converts lists)
    assert (
        wire.forward_backward_input(wire.parse_forward_backward(_request([plain])), slot=0).data[0].sampled_mask is None
    )


def test_topk_prompt_logprobs_reach_the_sdk_as_rows_per_prompt_position():
    ids = np.array([[0, 0], [7, 3], [2, 9]], np.int32)
    lps = np.array([[-99999.0, -99999.0], [-0.1, -2.5], [-0.7, -0.9]], np.float32)
    result = SampleResult(
        sequences=[SampledSequence(tokens=[4], logprobs=[-0.3], stop_reason="length")], topk_prompt_logprobs=(ids, lps)
    )
    resp = deserialize_sample_response(wire.sample_output(result))
    assert resp.prompt_logprobs is None
    rows = resp.topk_prompt_logprobs
    assert rows[0] is None and [t for t, _ in rows[1]] == [7, 3] and [t for t, _ in rows[2]] == [2, 9]
    np.testing.assert_allclose([lp for _, lp in rows[1]], [-0.1, -2.5], rtol=1e-6)
    req = types.SampleRequest(
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        sampling_params=types.SamplingParams(),
        num_samples=1,
        topk_prompt_logprobs=2,
        sampling_session_id="s:sample:0",
        seq_id=0,
    )
    assert wire.sample_input(req.model_dump_json().encode(), None).topk_prompt_logprobs == 2


def test_a_dtype_number_outside_the_enum_is_a_user_error_naming_it():
    """Found by the wire fuzz: protobuf keeps unknown enum numbers, and naming one raised a ValueError (a server
    error) instead of the InputError the field deserves."""
    from tinker.proto import tinker_public_pb2 as pb

    from tinkerflow.activities.wire import _tensor  # pyright: ignore[reportPrivateUsage]  (the decoder under test)
    from tinkerflow.common.errors import InputError

    tensor = pb.Tensor()
    tensor.dtype = 5  # pyright: ignore[reportAttributeAccessIssue]  (an enum number the schema does not define)
    with pytest.raises(InputError, match=r"loss_fn_inputs\['weights'\] has unsupported dtype 5"):
        _tensor("weights", tensor, "datum 0")


def _sample_body(**fields) -> bytes:
    body = {
        "prompt": {"chunks": [{"tokens": [1, 2, 3, 4], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 1},
        "sampling_session_id": "s:sample:0",
        "seq_id": 0,
        "type": "sample",
        **fields,
    }
    return json.dumps(body).encode()


def test_every_sample_request_field_reaches_the_engine():
    target = types.TensorData.from_torch_sparse(torch.tensor([[-1, 5], [7, -1], [-1, -1]]), pad_value=-1)
    body = _sample_body(
        topk_sample_logprobs=3,
        prompt_alt_tokens_k=2,
        prompt_logprobs=True,
        prompt_logprobs_last_n=2,
        target_prompt_logprobs=_tensor_data_to_model(target).model_dump(exclude_none=True),
    )
    inp = wire.sample_input(body, snapshot=None)
    assert (inp.topk_sample_logprobs, inp.prompt_alt_tokens_k, inp.prompt_logprobs_last_n) == (3, 2, 2)
    assert inp.target_prompt_logprobs.tolist() == [[-1, 5], [7, -1], [-1, -1]]
    assert inp.cache_namespace == "s:sample:0"


def test_sample_output_answers_every_field_in_the_sdk_types():
    """target_prompt_logprobs comes back in the request's layout (CSR at the listed cells), top-k of sampled tokens
    per sequence, prompt_alt_tokens as two [P-1, k] tensors, the cache hits."""
    target = types.TensorData.from_torch_sparse(torch.tensor([[-1, 5], [7, -1], [-1, -1]]), pad_value=-1)
    body = _sample_body(target_prompt_logprobs=_tensor_data_to_model(target).model_dump(exclude_none=True))
    values = np.array([[0.0, -1.5], [-2.5, 0.0], [0.0, 0.0]], np.float32)
    ids, lps = np.array([[3, 4]], np.int32), np.array([[-0.1, -2.0]], np.float32)
    result = SampleResult(
        sequences=[SampledSequence([3], [-0.1], "stop", topk_logprobs=(ids, lps))],
        target_prompt_logprobs=values,
        prompt_cache_hit_tokens=16,
        prompt_alt_tokens=(np.array([[1], [2], [3]], np.int64), np.array([[-1.0], [-2.0], [-3.0]], np.float32)),
    )
    decoded = deserialize_sample_response(wire.sample_output(result, body))
    got = decoded.target_prompt_logprobs
    assert got.sparse_crow_indices == target.sparse_crow_indices and got.dtype == "float32"
    assert got.to_numpy().tolist() == values.tolist()
    assert decoded.sequences[0].topk_logprobs == [[(3, pytest.approx(-0.1)), (4, -2.0)]]
    assert decoded.prompt_alt_tokens.tokens.to_numpy().tolist() == [[1], [2], [3]]
    assert decoded.prompt_cache_hit_tokens == 16
    plain = {"data": [-1, 5, 7, -1, -1, -1], "dtype": "int64", "shape": [3, 2]}
    dense = wire.sample_output(result, _sample_body(target_prompt_logprobs=plain))
    assert deserialize_sample_response(dense).target_prompt_logprobs.sparse_crow_indices is None


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ({"data": [1, 2], "dtype": "int64", "shape": [3, 100]}, "1 <= K <= 64"),
        (
            {
                "data": [1],
                "dtype": "int64",
                "shape": [2**40, 2],
                "sparse_crow_indices": [0, 1],
                "sparse_col_indices": [0],
            },
            "1 <= K <= 64",
        ),
        (
            {
                "data": [1, 2],
                "dtype": "int64",
                "shape": [3, 2],
                "sparse_crow_indices": [0, 5, 1, 2],
                "sparse_col_indices": [0, 9],
            },
            "CSR crow/col indices do not fit",
        ),
        ({"data": [1.5, 2.0], "dtype": "float32", "shape": [1, 2]}, "must be int64"),
    ],
)
def test_a_bad_target_tensor_is_a_user_error_before_any_allocation(target, message):
    with pytest.raises(InputError, match=re.escape(message)):
        wire.sample_input(_sample_body(target_prompt_logprobs=target), snapshot=None)


def test_a_body_whose_datums_do_not_parse_is_the_clients_error():
    """The API routes a forward_backward by its top-level fields alone; a corrupt datum surfaces here, as user input."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs=dict(target_tokens=[6, 7, 8], weights=[1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    body = bytearray(_request([datum]))
    at = body.index(b"weights") - 2  # the length of the datum's map entry: claim more bytes than it has
    body[at] = 0x7F
    with pytest.raises(InputError, match="not a valid ForwardBackwardRequest"):
        wire.parse_forward_backward(bytes(body))
