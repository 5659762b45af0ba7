"""StableReinforce's sampled tokens, checked against the server's stability records
(tinkerflow.common.stability_records).

A sample call whose body sets `record_stability_info` has its sequences recorded when the JAX worker has sampled
them (`record`). A `stable_reinforce` forward_backward names, in each datum's provenance, the sampled sequence behind
its sampled positions (`SampledProvenanceSpan(sequence_id, offset, length)`); `resolve` looks each one up in the
run's own session and holds the datum to it:

- the datum's tokens at a sampled span (its `target_tokens`, and its input tokens where `model_input` spans name
  one) must be the recorded tokens at `[offset, offset + length)`;
- the loss uses the sampler's recorded log-probs there, and the datum's `logprobs` must agree with them within
  LOGPROB_TOLERANCE (the cookbook sends the sampler's own numbers, which agree exactly; anything else would be a
  datum that is not what was sampled, or a mistake, and is refused rather than silently replaced);
- a sequence with no record (never sampled with record_stability_info, another session's or tenant's, collected
  after the store's retention, or its sample failed) is the user's error, naming the sequence and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from tinkerflow.common import stability_records
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workers.engine.training.losses import LOSSES_NEEDING_PROVENANCE
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, InputError, SampleResult
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import WorkItem

log = logging.getLogger(__name__)
# |datum logprob - recorded logprob| allowed: the documented agreement of the sampler's and the trainer's log-probs
# for the same weights (docs/wire-contract.md §Sampling), so a datum that recomputed them with the trainer passes.
LOGPROB_TOLERANCE = 1e-4


def asks_for_records(body: bytes) -> bool:
    """Whether a SampleRequest body (the API's canonical JSON) sets record_stability_info."""
    try:
        return json.loads(body).get("record_stability_info") is True
    except ValueError:
        return False


def record(store: ClaimCheckStore, item: WorkItem, body: bytes, result: SampleResult) -> None:
    """Record a sampled call's sequences when its request asked (before its answer is written: a client that has
    the answer can always train on it)."""
    if item.payload is None or not asks_for_records(body):
        return
    sequences = [
        stability_records.SampledSequence(np.asarray(s.tokens, np.int32), np.asarray(s.logprobs, np.float32))
        for s in result.sequences
    ]
    weights = stability_records.Weights(
        sampler_id=item.sample.sampler_id if item.sample else "", snapshot=item.snapshot
    )
    stability_records.write_sampled(store, item.payload.uri, item.session_id, weights, sequences)


def resolve(
    store: ClaimCheckStore, msg: pb.ForwardBackwardRequest, inp: ForwardBackwardInput, model_id: str
) -> ForwardBackwardInput:
    """`inp` with each datum's sampled positions checked against, and its logprobs taken from, the stability
    records of the run's session (module docstring); unchanged for losses that read no provenance."""
    if inp.loss_fn not in LOSSES_NEEDING_PROVENANCE:
        return inp
    lookup = stability_records.Lookup(store, names.session_of(model_id))
    data: list[Datum] = []
    for i, (datum, wire_datum) in enumerate(zip(inp.data, msg.data, strict=True)):
        inputs = datum.inputs or {}
        targets, logprobs = inputs.get("target_tokens"), inputs.get("logprobs")
        if targets is None or logprobs is None or targets.ndim != 1 or logprobs.ndim != 1:
            data.append(datum)  # validation names what is missing or misshapen
            continue
        if not wire_datum.loss_fn_input_spans:
            data.append(datum)  # validation says stable_reinforce needs provenance
            continue
        where = f"datum {i}"
        targets, recorded = np.asarray(targets), np.array(logprobs, np.float32)
        for sequence, pos, offset, length, j in _sampled(wire_datum.model_input_spans):
            span = f"{where}: model_input_spans[{j}]"
            if pos + length > len(datum.tokens):
                raise InputError(f"{span} runs past model_input's {len(datum.tokens)} tokens")
            want = _recorded(lookup, sequence, offset, length, span).tokens
            _same_tokens(datum.tokens[pos : pos + length], want, f"{where}: model_input", pos, sequence, offset)
        for sequence, pos, offset, length, j in _sampled(wire_datum.loss_fn_input_spans):
            seq = _recorded(lookup, sequence, offset, length, f"{where}: loss_fn_input_spans[{j}]")
            if pos + length > min(targets.size, recorded.size):
                break  # spans past the targets: validation refuses the datum by its lengths
            _same_tokens(targets[pos : pos + length], seq.tokens, f"{where}: target_tokens", pos, sequence, offset)
            sent, want = recorded[pos : pos + length], seq.logprobs
            off = np.flatnonzero(~(np.abs(sent - want) <= LOGPROB_TOLERANCE))
            if off.size:
                k = int(off[0])
                raise InputError(
                    f"{where}: logprobs[{pos + k}] is {float(sent[k])} but the sampler recorded {float(want[k])} for "
                    f"token {offset + k} of sequence {sequence!r} (allowed difference {LOGPROB_TOLERANCE}); "
                    "stable_reinforce trains against the sampler's recorded log-probs: send the sampled sequence's "
                    "own logprobs (SampledSequence.logprobs), or train with importance_sampling or ppo to use others"
                )
            recorded[pos : pos + length] = want
        data.append(dataclasses.replace(datum, inputs={**inputs, "logprobs": recorded}))
    return dataclasses.replace(inp, data=data)


def _sampled(spans: Seq[pb.ProvenanceSpan]) -> Iterator[tuple[str, int, int, int, int]]:
    """(sequence id, position in the field, offset, length, span index) of each sampled span, positions by order."""
    pos = 0
    for j, span in enumerate(spans):
        which = span.WhichOneof("span")
        if which is None:
            return  # validation (wire.py) refuses it
        arm = getattr(span, which)
        if which == "sampled_tokens" and arm.length > 0:
            yield arm.sequence_id, pos, int(arm.offset), int(arm.length), j
        pos += max(0, int(arm.length))


def _recorded(
    lookup: stability_records.Lookup, sequence: str, offset: int, length: int, where: str
) -> stability_records.SampledSequence:
    found = lookup.sequence(sequence)
    if found is None:
        raise InputError(
            f"{where} names sequence {sequence!r}, which has no stability record in this session: stable_reinforce "
            "trains on sequences sampled with record_stability_info=True (e.g. "
            "save_weights_and_get_sampling_client(record_stability_info=True)) by a sampler of the same session, "
            "within the store's retention (--store-retention-s); sample it that way, or train with importance_sampling"
        )
    n = len(found.sampled.tokens)
    if offset + length > n:
        raise InputError(
            f"{where} covers tokens {offset}..{offset + length - 1} of sequence {sequence!r}, which sampled {n}"
        )
    return stability_records.SampledSequence(
        found.sampled.tokens[offset : offset + length], found.sampled.logprobs[offset : offset + length]
    )


def _same_tokens(got: np.ndarray, want: np.ndarray, field: str, pos: int, sequence: str, offset: int) -> None:
    differ = np.flatnonzero(np.asarray(got).reshape(-1) != want)
    if differ.size:
        k = int(differ[0])
        raise InputError(
            f"{field}[{pos + k}] is {int(got[k])} but sequence {sequence!r} sampled {int(want[k])} as its token "
            f"{offset + k}; a SampledProvenanceSpan must cover the very tokens its sequence sampled, in order"
        )
