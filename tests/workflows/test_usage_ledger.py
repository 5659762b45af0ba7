"""Metering: an op's usage comes home in its Outcome and the workflow that accepts the answer records it exactly once
(workflows/protocol/usage.py): a retried op adds nothing, an op re-run after its worker died counts once, automatic
snapshots are not the user's, and a SampleRequest writes its calls' usage into its memo with the owner as a search
attribute."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from mock_engine import MockEngine, blob, fwd_flags
from wf_harness import Tinker, body_hash, eventually, tinker_world, within

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
    AdamSpec,
    Outcome,
    RunState,
    SamplerInfo,
    SampleStart,
    SaveRequest,
    TrainingOp,
    WorkItem,
)
from tinkerflow.workflows.protocol.usage import (
    OpUsage,
    add_to,
    hour_end,
    hour_of,
    hour_start,
    ledger_from_memo,
    ledger_memo,
)
from tinkerflow.workflows.sample_request import SampleRequestWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

FWD = OpUsage(training_tokens=3)
SAMPLE = OpUsage(prefill_tokens=5, prefill_cached_tokens=2, sampled_tokens=4)
SAVE = OpUsage(checkpoints=1, checkpoint_bytes=1234)


class MeteringEngine(MockEngine):
    """The mock engine, answering with the usage the JAX worker would count."""

    def answer(self, item: WorkItem) -> Outcome:
        outcome = super().answer(item)
        usage = {"forward_backward": FWD, "sample": SAMPLE, "save_checkpoint": SAVE}.get(item.kind)
        return Outcome(json=outcome.json, blob=outcome.blob, usage=usage) if outcome.ok and usage else outcome


def total(ledger: dict[str, OpUsage]) -> OpUsage:
    return sum(ledger.values(), OpUsage())


# --- the record types -------------------------------------------------------------------------------------------------


def test_usage_adds_field_by_field_and_an_empty_one_is_false() -> None:
    assert OpUsage(3, 5, 2, 4, 1, 1234) == FWD + SAMPLE + SAVE
    assert not OpUsage() and SAMPLE
    assert SAMPLE.prefill_uncached_tokens == 3


def test_hour_buckets_and_the_memo_round_trip() -> None:
    t = datetime(2026, 7, 13, 14, 59, 59, 999, tzinfo=UTC)
    assert hour_of(t) == "2026-07-13T14:00:00Z"
    assert hour_start("2026-07-13T14:00:00Z") == datetime(2026, 7, 13, 14, tzinfo=UTC)
    assert hour_end("2026-07-13T23:00:00Z") == datetime(2026, 7, 14, 0, tzinfo=UTC)
    ledger: dict[str, OpUsage] = {}
    add_to(ledger, "2026-07-13T14:00:00Z", FWD)
    add_to(ledger, "2026-07-13T14:00:00Z", FWD)
    add_to(ledger, "2026-07-13T15:00:00Z", OpUsage())  # nothing used: no bucket
    assert ledger == {"2026-07-13T14:00:00Z": OpUsage(training_tokens=6)}
    assert ledger_from_memo(ledger_memo(ledger)) == ledger
    # A newer writer's field is skipped, a missing one is 0; garbage is no usage.
    assert OpUsage.from_dict({"sampled_tokens": 2, "image_tokens": 9}) == OpUsage(sampled_tokens=2)
    assert ledger_from_memo("nonsense") == {}


# --- the training run ------------------------------------------------------------------------------------------------


@pytest.fixture
async def metered(temporal_env):
    async with tinker_world(temporal_env.client, engine=MeteringEngine()) as world:
        yield world


async def test_a_runs_ops_are_metered_once_each(metered: Tinker) -> None:
    tinker = metered
    sid, _ = await tinker.start_session()
    _, run = await tinker.ready_run(sid, 1, snapshot_every=1)
    first = tinker.fwd(1)
    await tinker.op(run, first)
    assert (await tinker.op(run, first)).ok  # a retried op: its first answer, metered already
    adam = AdamSpec(learning_rate=1e-4)
    optim = await tinker.op(run, TrainingOp(seq_id=2, kind="optim_step", body_hash=body_hash("o", 2), adam=adam))
    assert optim.ok  # snapshot_every=1: an automatic snapshot was saved, which is not the user's checkpoint
    save = TrainingOp(seq_id=3, kind="save_weights", body_hash=body_hash("s", 3), save=SaveRequest(path="mine"))
    assert (await tinker.op(run, save)).ok
    # A worker that dies under a forward_backward: the run restores and runs it again; it counts once.
    held = await tinker.submit(run, tinker.fwd(4, hold=True))
    await tinker.engine.wait_for(lambda: any("hold" in fwd_flags(i) for i in tinker.engine.items))
    await tinker.register(tinker.queues[0])

    async def restoring() -> bool:
        state: RunState = await run.query(TrainingRunWorkflow.describe)
        return state.recoveries == 1

    await eventually(restoring, timeout=10)
    tinker.engine.release.set()
    assert (await within(held.result())).ok
    assert len(tinker.engine.of_kind("forward_backward")) >= 3  # the first try, the replay and the re-run

    ledger = await run.query(TrainingRunWorkflow.usage)
    assert total(ledger) == OpUsage(training_tokens=6, checkpoints=1, checkpoint_bytes=1234)
    assert list(ledger) == [hour_of(datetime.now(UTC))] or len(ledger) == 2  # an hour may turn during the test


# --- sampling ---------------------------------------------------------------------------------------------------------


async def test_a_sample_batch_meters_its_calls_into_its_memo(metered: Tinker) -> None:
    tinker = metered
    sid, _ = await tinker.start_session()
    sampler = SamplerInfo(sampler_id=names.sampler_id_for(sid, 1), base_model=tinker.base_model, owner="tenant-a")
    handle = await tinker.client.start_workflow(
        SampleRequestWorkflow.run,
        SampleStart(sampler=sampler, payloads=[blob("mem://s/0"), blob("mem://s/1")]),
        id=names.sample_workflow_id(sampler.sampler_id, body_hash("usage", sid)),
        task_queue=tinker.workflow_queue,
    )
    tinker.started.append(handle)
    outcomes = await within(handle.result())
    assert [o.usage for o in outcomes] == [SAMPLE, SAMPLE]
    described = await handle.describe()
    memo = await described.memo()
    assert total(ledger_from_memo(memo["usage"])) == SAMPLE + SAMPLE
    assert (memo["session_id"], memo["base_model"]) == (sid, tinker.base_model)
    assert described.typed_search_attributes.get(names.OWNER) == "tenant-a"
