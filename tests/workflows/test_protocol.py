"""The typed run <-> Coordinator protocol (workflows/protocol/work.py, workflows/protocol/messages.py) through
Temporal's default data converter: new shapes round-trip, and every payload recorded before typed fields existed
(tests/replay/histories: `params` dicts, string kinds) still decodes, into the typed fields. No server: the converter
alone."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.api.common.v1 import Payload
from temporalio.converter import DataConverter

from tinkerflow.activities.engine_activities import EngineActivities
from tinkerflow.activities.specs import lora_config, optim_config
from tinkerflow.workers.engine.types import AdamConfig, DimuonConfig, LoraConfig
from tinkerflow.workflows.protocol.messages import (
    AdamSpec,
    Batch,
    BlobRef,
    DropSnapshots,
    LoadCheckpoint,
    LoggedOp,
    LoraSpec,
    OpKind,
    PageMoves,
    RunStart,
    RunState,
    SampleParams,
    SaveCheckpoint,
    SaveRequest,
    SlotMove,
    TenantLimit,
    TrainingOp,
    WorkItem,
    WorkKind,
)
from tinkerflow.workflows.protocol.work import KIND_LABELS

HISTORIES = sorted((Path(__file__).parents[1] / "replay" / "histories").glob("*.json"))
# Recorded before the typed fields (kinds and parameters in `params` dicts) and after (`record.py --add typed`).
LEGACY = [p for p in HISTORIES if "-typed-" not in p.name]
TYPED = [p for p in HISTORIES if "-typed-" in p.name]
CONVERTER = DataConverter.default.payload_converter
REF = BlobRef(uri="file:///store/requests/x", size=12, sha256="ab" * 32)

# The typed field each kind must carry once decoded (None: the kind has no parameters).
TYPED_FIELD = {
    WorkKind.CREATE_ADAPTER: "lora",
    WorkKind.OPTIM_STEP: "adam",
    WorkKind.SNAPSHOT: "snapshot",
    WorkKind.SAMPLE: "sample",
    WorkKind.DROP_SNAPSHOTS: "drop",
    WorkKind.SAVE_CHECKPOINT: "save",
    WorkKind.LOAD_CHECKPOINT: "load",
    WorkKind.LOAD_SNAPSHOT: "load",
    WorkKind.PAGE: "page",
    WorkKind.FREE_ADAPTER: None,
    WorkKind.FORWARD_BACKWARD: None,
}


def _round_trip(value: Any, hint: Any) -> Any:
    return CONVERTER.from_payloads(CONVERTER.to_payloads([value]), [hint])[0]


def _recorded(kinds: dict[tuple[str, str], Any], paths: list[Path], raw: bool = False) -> list[Any]:
    """Every payload of the recorded histories sent as one of `kinds` ((event attributes key, name) -> type);
    `raw`: the payloads' JSON as recorded instead of decoded."""
    found = []
    for path in paths:
        for event in json.loads(path.read_text())["history"]["events"]:
            for key, attrs in event.items():
                if not key.endswith("EventAttributes"):
                    continue
                if "acceptedRequest" in attrs:  # an update: its name and args sit in the request
                    name, payloads = (
                        attrs["acceptedRequest"]["input"]["name"],
                        attrs["acceptedRequest"]["input"].get("args", {}).get("payloads", []),
                    )
                else:
                    name = attrs.get("signalName") or (attrs.get("activityType") or {}).get("name", "")
                    payloads = (attrs.get("input") or {}).get("payloads", [])
                hint = kinds.get((key, name))
                if hint is not None and payloads:
                    payload = json_format.ParseDict(payloads[0], Payload())
                    found.append(json.loads(payload.data) if raw else CONVERTER.from_payloads([payload], [hint])[0])
    return found


WORK_ITEM_EVENTS = {
    ("workflowExecutionSignaledEventAttributes", "submit"): WorkItem,
    ("workflowExecutionSignaledEventAttributes", "submit_many"): list[WorkItem],
    ("signalExternalWorkflowExecutionInitiatedEventAttributes", "submit"): WorkItem,
    ("signalExternalWorkflowExecutionInitiatedEventAttributes", "submit_many"): list[WorkItem],
    ("activityTaskScheduledEventAttributes", "run_batch"): Batch,
}
OP_EVENTS = {("workflowExecutionUpdateAcceptedEventAttributes", "op"): TrainingOp}


def _work_items_recorded(paths: list[Path]) -> list[WorkItem]:
    items: list[WorkItem] = []
    for value in _recorded(WORK_ITEM_EVENTS, paths):
        items.extend(value.items if isinstance(value, Batch) else value if isinstance(value, list) else [value])
    return items


def _check_typed(item: WorkItem) -> None:
    assert isinstance(item.kind, WorkKind) and item.params == {}, item
    name = TYPED_FIELD[item.kind]
    if name is not None:
        assert getattr(item, name), f"{item.kind} decoded without its {name}: {item}"


@pytest.mark.parametrize("paths", [LEGACY, TYPED], ids=["legacy", "typed"])
def test_every_recorded_work_item_decodes_into_typed_fields(paths: list[Path]) -> None:
    items = _work_items_recorded(paths)
    for item in items:
        _check_typed(item)
    kinds = Counter(i.kind for i in items)
    # What the recorded scenarios exercise (train, sample, checkpoints, recovery, sampler weights from storage).
    assert {
        WorkKind.CREATE_ADAPTER,
        WorkKind.FORWARD_BACKWARD,
        WorkKind.OPTIM_STEP,
        WorkKind.SNAPSHOT,
        WorkKind.SAMPLE,
        WorkKind.SAVE_CHECKPOINT,
        WorkKind.LOAD_CHECKPOINT,
    } <= set(kinds), kinds
    creates = [i for i in items if i.kind is WorkKind.CREATE_ADAPTER]
    assert all(
        i.lora is not None and i.lora.rank == 4 and i.lora.seed is not None for i in creates
    )  # record.py: rank=4, a drawn seed
    adams = [i.adam for i in items if i.kind is WorkKind.OPTIM_STEP]
    assert all(
        a is not None and a.learning_rate == pytest.approx(1e-3) and a.beta2 == pytest.approx(0.95) for a in adams
    )


@pytest.mark.parametrize("paths", [LEGACY, TYPED], ids=["legacy", "typed"])
def test_every_recorded_training_op_decodes_into_typed_fields(paths: list[Path]) -> None:
    ops: list[TrainingOp] = _recorded(OP_EVENTS, paths)
    assert ops
    for op in ops:
        assert isinstance(op.kind, OpKind) and op.params == {}, op
        if op.kind is OpKind.FORWARD_BACKWARD:
            assert op.payload is not None
        if op.kind is OpKind.OPTIM_STEP:
            assert op.adam is not None and op.adam.learning_rate == pytest.approx(1e-3)
        if op.kind in (OpKind.SAVE_WEIGHTS, OpKind.SAVE_WEIGHTS_FOR_SAMPLER, OpKind.SAVE_WEIGHTS_EXTERNAL):
            assert op.save is not None
    kinds = {op.kind for op in ops}
    assert {OpKind.FORWARD_BACKWARD, OpKind.OPTIM_STEP, OpKind.SAVE_WEIGHTS, OpKind.SAVE_WEIGHTS_FOR_SAMPLER} <= kinds
    named = [
        op.save
        for op in ops
        if op.kind is OpKind.SAVE_WEIGHTS_FOR_SAMPLER and op.save is not None and op.save.path == "replay-weights"
    ]
    # record.py's usual scenario: "replay-weights", ttl_seconds=3600, once per recording (the sampler-restart one
    # saves "replay" without a TTL)
    assert named and [s.ttl_seconds for s in named] == [3600] * len(named)


def test_training_items_recorded_since_run_metrics_carry_their_ops_seq_id_and_step() -> None:
    """The run workflow tags its forward_backward and optim_step items (patch "run-metrics-tags") so the JAX worker
    can record each op's metric point; the recovery replays it sends carry no seq_id (they record nothing)."""
    tagged = [p for p in TYPED if "-metrics-" in p.name]
    items = [i for i in _work_items_recorded(tagged) if i.kind in (WorkKind.FORWARD_BACKWARD, WorkKind.OPTIM_STEP)]
    seqs = [i.seq_id for i in items if i.seq_id is not None]
    assert len(seqs) > 10 and all(s >= 1 for s in seqs)
    steps = [i.step for i in items if i.kind is WorkKind.OPTIM_STEP and i.seq_id is not None]
    assert min(steps) == 0 and max(steps) > 0  # the run's step as each optim_step began (items recur: signal, batch)
    untagged = [p for p in TYPED if "-metrics-" not in p.name]
    assert all(i.seq_id is None for i in _work_items_recorded(untagged))


def test_the_two_recordings_hold_the_two_shapes() -> None:
    """The legacy histories carry params dicts (what the converters must read); the typed ones carry none."""

    def params_seen(paths: list[Path]) -> int:
        raw = _recorded({**WORK_ITEM_EVENTS, **OP_EVENTS}, paths, raw=True)
        items = [i for r in raw for i in (r["items"] if "items" in r else r if isinstance(r, list) else [r])]
        return sum(1 for i in items if i.get("params"))

    assert LEGACY and TYPED
    assert params_seen(LEGACY) > 20 and params_seen(TYPED) == 0


def test_a_legacy_replay_log_decodes_into_logged_ops() -> None:
    """RunState carried across continue-as-new before the typed log held dicts; loads said "load_weights"."""
    start = RunStart(model_id="s:train:0", session_id="s", owner="o", base_model="m", lora=LoraSpec(rank=4))
    legacy = {
        "start": json.loads(CONVERTER.to_payloads([start])[0].data),
        "auto_snapshot": "tinker://s:train:0/x",
        "since_snapshot": [
            {
                "kind": "forward_backward",
                "payload": {"uri": REF.uri, "size": REF.size, "sha256": REF.sha256},
                "params": {},
            },
            {
                "kind": "optim_step",
                "params": {
                    "learning_rate": 0.5,
                    "beta1": 0.8,
                    "beta2": 0.9,
                    "eps": 1e-8,
                    "weight_decay": 0.1,
                    "grad_clip_norm": 1.0,
                },
            },
            {"kind": "load_weights", "params": {"path": "tinker://a:train:0/weights/w", "optimizer": True}},
        ],
    }
    state = CONVERTER.from_payloads(
        [Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(legacy).encode())], [RunState]
    )[0]
    assert state.since_snapshot == [
        LoggedOp(WorkKind.FORWARD_BACKWARD, payload=REF),
        LoggedOp(WorkKind.OPTIM_STEP, adam=AdamSpec(0.5, 0.8, 0.9, 1e-8, 0.1, 1.0)),
        LoggedOp(WorkKind.LOAD_CHECKPOINT, load=LoadCheckpoint("tinker://a:train:0/weights/w", optimizer=True)),
    ]
    assert _round_trip(state, RunState) == state


def test_kinds_travel_as_the_same_strings_as_before() -> None:
    payload = CONVERTER.to_payloads([WorkItem(key="k", requester="r", kind=WorkKind.FORWARD_BACKWARD)])[0]
    assert json.loads(payload.data)["kind"] == "forward_backward"
    op = CONVERTER.to_payloads([TrainingOp(seq_id=1, kind=OpKind.SAVE_WEIGHTS_FOR_SAMPLER, body_hash="h")])[0]
    assert json.loads(op.data)["kind"] == "save_weights_for_sampler"


def test_an_unknown_op_kind_still_decodes_so_it_fails_in_sequence_not_at_submit() -> None:
    """An API newer than this worker may send a kind it does not know: the op must reach the run
    (docs/architecture.md §What durability promises)."""
    op = _round_trip(TrainingOp(seq_id=3, kind="frobnicate", body_hash="h"), TrainingOp)
    assert op.kind == "frobnicate" and not isinstance(op.kind, OpKind)


specs = {
    "lora": st.builds(
        LoraSpec,
        rank=st.integers(1, 256),
        seed=st.none() | st.integers(0, 2**31 - 1),
        train_attn=st.booleans(),
        train_mlp=st.booleans(),
        train_unembed=st.booleans(),
    ),
    "adam": st.builds(
        AdamSpec,
        learning_rate=st.floats(0, 1),
        beta1=st.floats(0, 0.999),
        beta2=st.floats(0, 0.999),
        eps=st.floats(1e-12, 1e-3),
        weight_decay=st.floats(0, 1),
        grad_clip_norm=st.floats(0, 10),
    ),
    "snapshot": st.text(min_size=1, max_size=40),
    "sample": st.builds(
        SampleParams, sampler_id=st.text(max_size=20), samples=st.integers(1, 64), work=st.integers(0, 10**6)
    ),
    "drop": st.builds(
        DropSnapshots,
        keys=st.none() | st.lists(st.text(max_size=20), max_size=4),
        queue=st.text(max_size=20),
        prefix=st.text(max_size=20),
    ),
    "save": st.builds(
        SaveCheckpoint,
        path=st.text(min_size=1, max_size=30),
        manifest=st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3),
        overwrite=st.booleans(),
        age_recipients=st.lists(st.text(max_size=10), max_size=2),
    ),
    "load": st.builds(LoadCheckpoint, path=st.text(min_size=1, max_size=30), optimizer=st.booleans()),
    "page": st.builds(
        PageMoves,
        page_out=st.lists(st.builds(SlotMove, model_id=st.text(max_size=20), slot=st.integers(0, 64)), max_size=3),
        page_in=st.lists(st.builds(SlotMove, model_id=st.text(max_size=20), slot=st.integers(0, 64)), max_size=3),
        drop=st.lists(st.text(max_size=20), max_size=2),
    ),
}


@st.composite
def work_items(draw) -> WorkItem:
    kind = draw(st.sampled_from(list(WorkKind)))
    name = TYPED_FIELD[kind]
    fields = {name: draw(specs[name])} if name else {}
    return WorkItem(
        key=draw(st.text(min_size=1, max_size=20)),
        requester="training-run/s:train:0",
        kind=kind,
        model_id=draw(st.text(max_size=20)),
        payload=draw(st.none() | st.just(REF)),
        slot=draw(st.integers(-1, 64)),
        seq_id=draw(st.none() | st.integers(0, 2**53)),  # the run-metrics tag of a training op
        step=draw(st.integers(0, 10**9)),
        tenant=draw(
            st.none() | st.builds(TenantLimit, owner=st.text(max_size=12), max_live_runs=st.integers(0, 10**4))
        ),
        **fields,
    )


@settings(max_examples=150, deadline=None)
@given(items=st.lists(work_items(), max_size=5))
def test_typed_work_items_round_trip_through_the_default_converter(items: list[WorkItem]) -> None:
    batch = Batch(items=items, incarnation="i")
    assert _round_trip(batch, Batch) == batch


@settings(max_examples=100, deadline=None)
@given(
    adam=st.none() | specs["adam"],
    load=st.none() | specs["load"],
    save=st.none()
    | st.builds(
        SaveRequest,
        path=st.none() | st.text(max_size=20),
        sampling_session_seq_id=st.none() | st.integers(0, 2**31),
        ttl_seconds=st.none() | st.integers(1, 10**7),
        user_metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        overwrite=st.booleans(),
    ),
    kind=st.sampled_from(list(OpKind)),
)
def test_typed_training_ops_round_trip_through_the_default_converter(adam, load, save, kind) -> None:
    op = TrainingOp(seq_id=7, kind=kind, body_hash="h", payload=REF, adam=adam, save=save, load=load, error="e")
    assert _round_trip(op, TrainingOp) == op


def test_the_activity_has_one_handler_per_kind_and_converts_specs_explicitly() -> None:
    acts = EngineActivities(engine=None, store=None)  # type: ignore[arg-type]
    assert set(acts.handlers) == set(WorkKind)
    assert set(KIND_LABELS) == set(WorkKind) == set(TYPED_FIELD)  # the Coordinator names each kind in the UI
    assert lora_config(LoraSpec(rank=8, seed=3, train_mlp=False)) == LoraConfig(rank=8, seed=3, train_mlp=False)
    assert optim_config(AdamSpec(1e-3, weight_decay=0.1)) == AdamConfig(1e-3, weight_decay=0.1)
    dimuon = AdamSpec(
        0.05, beta1=0.5, grad_clip_norm=1.0, optimizer="dimuon", damping=0.2, rank_lr_correction_exponent=0
    )
    assert optim_config(dimuon) == DimuonConfig(
        0.05, grad_clip_norm=1.0, beta1=0.5, damping=0.2, rank_lr_correction_exponent=0.0
    )
    # Every field of the engine's configs is set from the spec (a new field on either side must be mapped).
    assert list(LoraConfig.__dataclass_fields__) == list(LoraSpec.__dataclass_fields__)
    engine_fields = {*AdamConfig.__dataclass_fields__, *DimuonConfig.__dataclass_fields__, "optimizer"}
    assert set(AdamSpec.__dataclass_fields__) == engine_fields
