"""Stability records and the stable_reinforce check against them (activities/stability_checks.py), on a local store: the
SDK's own protobuf encoder builds the requests, as rl_loop builds its datums. The JAX worker's half of a record is
written by `record` from a SampleResult; the API's half as `asample` writes it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinkerflow.activities import stability_checks, wire
from tinkerflow.common import stability_records as records
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workers.engine.types import InputError, SampledSequence, SampleResult
from tinkerflow.workflows.protocol.messages import BlobRef, SampleParams, WorkItem, WorkKind

SESSION = "sess-a"
CALL = f"sample/{SESSION}:sample:0/batch1#0"
PROMPT = [1, 2, 3]
SAMPLED = [[10, 11, 12, 13], [20, 21, 22]]
LOGPROBS = [[-0.5, -1.25, -2.0, -0.125], [-3.0, -0.75, -1.5]]


def _store(tmp_path, session: str = SESSION, call: str = CALL, payload: str = "file:///body-1") -> ClaimCheckStore:
    """A store holding one recorded call of two sequences, as the API and the JAX worker write it."""
    store = ClaimCheckStore((tmp_path / "store").as_uri())
    weights = records.Weights(f"{session}:sample:0", "tiny", "", "")
    records.write_call(store, records.CallRecord(call, payload, "owner-a", session, weights))
    item = WorkItem(
        key="k",
        requester=call.rsplit("#", 1)[0],
        kind=WorkKind.SAMPLE,
        session_id=session,
        payload=BlobRef(payload, 1, "0"),
        sample=SampleParams(sampler_id=weights.sampler_id),
    )
    result = SampleResult([SampledSequence(t, lp, "length") for t, lp in zip(SAMPLED, LOGPROBS)])
    stability_checks.record(store, item, json.dumps({"record_stability_info": True}).encode(), result)
    return store


def _datum(seq: int = 0, sequence_id: str = f"{CALL}#0", **change) -> types.Datum:
    """rl_loop's datum for sampled sequence `seq`: the prompt and all but the last token in, targets shifted by one
    (zeros on the prompt), the sampler's log-probs and an advantage on the sampled tokens."""
    tokens, lps, ob = SAMPLED[seq], LOGPROBS[seq], len(PROMPT) - 1
    fields = {
        "target_tokens": [0] * ob + tokens,
        "logprobs": [0.0] * ob + lps,
        "advantages": [0.0] * ob + [1.0] * len(tokens),
        "model_input": PROMPT + tokens[:-1],
    }
    fields.update(change)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(fields.pop("model_input")),
        loss_fn_inputs={
            k: types.TensorData.from_numpy(np.asarray(v, np.int64 if k == "target_tokens" else np.float32))
            for k, v in fields.items()
        },
    )
    n = len(tokens)
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=n),
        ],
    )


def _resolve(store: ClaimCheckStore, data: list[types.Datum], loss: str = "stable_reinforce", session: str = SESSION):
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss),  # pyright: ignore[reportArgumentType]
        model_id=f"{session}:train:0",
        seq_id=1,
    )
    msg = wire.parse_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    return stability_checks.resolve(store, msg, wire.forward_backward_input(msg, slot=0), f"{session}:train:0")


def test_the_loss_reads_the_recorded_logprobs_and_the_records_round_trip_exactly(tmp_path):
    store = _store(tmp_path)
    # The datum's log-probs a little off the record (within the tolerance): the record's exact values are used.
    sent = [0.0, 0.0] + [x + 5e-5 for x in LOGPROBS[1]]
    inp = _resolve(store, [_datum(), _datum(1, f"{CALL}#1", logprobs=sent)])
    assert inp.data[0].inputs["logprobs"].tolist() == [0.0, 0.0, *LOGPROBS[0]]
    assert inp.data[1].inputs["logprobs"].tolist() == [0.0, 0.0, *LOGPROBS[1]]
    found = records.Lookup(store, SESSION).sequence(f"{CALL}#1")
    assert found is not None and found.sampled.tokens.tolist() == SAMPLED[1]
    assert found.call.weights.sampler_id == f"{SESSION}:sample:0" and found.call.owner == "owner-a"


def test_a_token_that_is_not_what_the_sequence_sampled_is_refused(tmp_path):
    store = _store(tmp_path)
    tokens = r"datum 0: target_tokens\[4\] is 99 but sequence .*#0' sampled 12 as its token 2"
    with pytest.raises(InputError, match=tokens):
        _resolve(store, [_datum(target_tokens=[0, 0, 10, 11, 99, 13])])
    with pytest.raises(InputError, match=r"datum 0: model_input\[4\] is 98 but .* sampled 11 as its token 1"):
        _resolve(store, [_datum(model_input=[1, 2, 3, 10, 98, 12])])


def test_logprobs_beyond_the_tolerance_and_spans_past_the_sequence_are_refused(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(InputError, match=r"datum 0: logprobs\[3\] is -0.5 but the sampler recorded -1.25"):
        _resolve(store, [_datum(logprobs=[0.0, 0.0, -0.5, -0.5, -2.0, -0.125])])
    inputs = {
        k: types.TensorData.from_numpy(v)
        for k, v in (
            ("target_tokens", np.array([0, 0, 20, 21, 22, 23])),
            ("logprobs", np.zeros(6, np.float32)),
            ("advantages", np.zeros(6, np.float32)),
        )
    }
    longer = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 20, 21, 22]), loss_fn_inputs=inputs)
    longer = longer.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="p", length=6)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="p", length=2),
            types.SampledProvenanceSpan(sequence_id=f"{CALL}#1", length=4),
        ],
    )
    with pytest.raises(InputError, match=r"covers tokens 0..3 of sequence .*#1', which sampled 3"):
        _resolve(store, [longer])


@pytest.mark.parametrize(
    "sequence_id",
    [f"{CALL}#2", f"sample/{SESSION}:sample:0/batch2#0#0", "q", "sample/x#y#z", "sample/other:sample:0/b#0#0"],
)
def test_a_sequence_without_a_record_is_refused_naming_it(tmp_path, sequence_id):
    store = _store(tmp_path)
    with pytest.raises(InputError, match=f"names sequence '{sequence_id}', which has no stability record in this"):
        _resolve(store, [_datum(sequence_id=sequence_id)])


def test_another_sessions_record_is_refused_like_a_missing_one(tmp_path):
    store = _store(tmp_path, session="sess-b", call="sample/sess-b:sample:0/batch1#0")
    with pytest.raises(InputError, match="names sequence 'sample/sess-b:sample:0/batch1#0#0', which has no stability"):
        _resolve(store, [_datum(sequence_id="sample/sess-b:sample:0/batch1#0#0")])
    # The API's half without the JAX worker's (a sample that failed, or has not finished): no record either.
    bare = ClaimCheckStore((tmp_path / "bare").as_uri())
    records.write_call(bare, records.CallRecord(CALL, "file:///b", "o", SESSION, records.Weights("s")))
    with pytest.raises(InputError, match="has no stability record"):
        _resolve(bare, [_datum()])


def test_other_losses_read_no_records_and_unasked_samples_write_none(tmp_path):
    empty = ClaimCheckStore((tmp_path / "empty").as_uri())
    inp = _resolve(empty, [_datum(sequence_id="anything")], loss="importance_sampling")
    assert inp.data[0].inputs["logprobs"].tolist() == [0.0, 0.0, *LOGPROBS[0]]
    item = WorkItem(key="k", requester="r", kind=WorkKind.SAMPLE, session_id=SESSION, payload=BlobRef("u", 1, "0"))
    stability_checks.record(empty, item, b'{"record_stability_info":false}', SampleResult([]))
    assert not empty.fs.exists(f"{empty.root}/{records.KIND}")


SPAN = st.tuples(
    st.booleans(), st.sampled_from([f"{CALL}#0", f"{CALL}#1", f"{CALL}#7", "x"]), st.integers(0, 6), st.integers(0, 6)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spans=st.lists(SPAN, min_size=1, max_size=5), targets=st.lists(st.integers(0, 30), min_size=1, max_size=9))
def test_hostile_spans_are_refused_as_the_users_error_or_resolve(tmp_path, spans, targets):
    """Whatever spans and targets a client sends, resolve answers a user error or a datum: it never fails otherwise."""
    store = _store(tmp_path)
    n = len(targets)
    kinds = {True: types.SampledProvenanceSpan, False: types.PromptProvenanceSpan}
    made = [kinds[sampled](sequence_id=s, offset=o, length=k) for sampled, s, o, k in spans]
    zeros = types.TensorData.from_numpy(np.zeros(n, np.float32))
    target = types.TensorData.from_numpy(np.asarray(targets, np.int64))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(targets),
        loss_fn_inputs={"target_tokens": target, "logprobs": zeros, "advantages": zeros},
        model_input_spans=made,
        loss_fn_input_spans=made,
    )
    try:
        _resolve(store, [datum])
    except InputError:
        pass


def test_a_misshapen_datum_is_left_as_it_is_for_validation_to_refuse(tmp_path):
    datum = _datum()
    column = types.TensorData.from_numpy(datum.loss_fn_inputs["logprobs"].to_numpy().reshape(-1, 1))
    misshapen = dataclasses.replace(datum, loss_fn_inputs={**datum.loss_fn_inputs, "logprobs": column})
    assert _resolve(_store(tmp_path), [misshapen]).data[0].inputs["logprobs"].shape == (6, 1)


@pytest.mark.parametrize("which", ["call", "sampled"])
def test_an_unreadable_record_is_answered_as_a_missing_one(tmp_path, which):
    store = _store(tmp_path)
    key = CALL if which == "call" else "file:///body-1"
    path = records._path(store, key, which)
    for garbage in (
        b"not json",
        json.dumps({"format": 1, "call": CALL, "session_id": SESSION}).encode(),
        json.dumps(
            {"format": 1, "payload": "file:///body-1", "session_id": SESSION, "sequences": [{"tokens": "%%%"}]}
        ).encode(),
    ):
        store.fs.pipe_file(path, garbage)
        with pytest.raises(InputError, match="has no stability record"):
            _resolve(store, [_datum()])
