"""Fairness between tenants in the Coordinator: a tenant's long queue does not delay another tenant's
single request by more than the stated bound (its oldest item is in the next batch). Counts and order, no clocks."""

from __future__ import annotations

from mock_engine import blob, fwd_flags
from wf_harness import Tinker, body_hash, eventually, within

from tinkerflow.workflows.coordinator.fairness import fair_order
from tinkerflow.workflows.coordinator.workflow import MAX_BATCH_ITEMS
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import SamplerInfo, SampleStart, WorkItem
from tinkerflow.workflows.protocol.work import WorkKind
from tinkerflow.workflows.sample_request import SampleRequestWorkflow


def _item(key: str, session: str) -> WorkItem:
    return WorkItem(key=key, requester=f"req-{session}", kind=WorkKind.SAMPLE, session_id=session)


def test_fair_order_is_round_robin_over_sessions_and_keeps_each_sessions_order():
    items = [_item(f"a{i}", "A") for i in range(5)] + [_item("b0", "B"), _item("c0", "C"), _item("b1", "B")]
    assert [i.key for i in fair_order(items)] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    assert fair_order([]) == []


async def _sample(tinker: Tinker, session_id: str, n: int, tag: str):
    sampler = SamplerInfo(sampler_id=names.sampler_id_for(session_id, 1), base_model=tinker.base_model)
    handle = await tinker.client.start_workflow(
        SampleRequestWorkflow.run,
        SampleStart(sampler=sampler, payloads=[blob(f"mem://{tag}/{i}") for i in range(n)]),
        id=names.sample_workflow_id(sampler.sampler_id, body_hash(tag, n)),
        task_queue=tinker.workflow_queue,
    )
    tinker.started.append(handle)
    return handle


async def test_a_big_queue_of_one_tenant_does_not_delay_another_tenants_small_request(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    _, run = await tinker.ready_run(sid, 1)
    engine = tinker.engine
    held = await tinker.submit(run, tinker.fwd(1, hold=True))  # the worker is busy: everything below queues
    await engine.wait_for(lambda: any("hold" in fwd_flags(i) for i in engine.items))
    busy = len(engine.batches)

    big_session, _ = await tinker.start_session()
    small_session, _ = await tinker.start_session()
    big = await _sample(tinker, big_session, MAX_BATCH_ITEMS + 10, "big")
    await eventually(lambda: _pending_is(tinker, MAX_BATCH_ITEMS + 10))
    small = await _sample(tinker, small_session, 1, "small")
    await eventually(lambda: _pending_is(tinker, MAX_BATCH_ITEMS + 11))

    engine.release.set()
    assert (await within(held.result())).ok
    [small_outcome] = await within(small.result())
    assert small_outcome.ok
    # First come, first served would have sent MAX_BATCH_ITEMS of the big request first and the small one a batch
    # later; fair order puts it in the very next batch, next to the big tenant's first items.
    next_batch = engine.batches[busy]
    assert "mem://small/0" in [i.payload.uri for i in next_batch.items if i.payload]
    assert len(next_batch.items) == MAX_BATCH_ITEMS
    outcomes = await within(big.result())
    assert len(outcomes) == MAX_BATCH_ITEMS + 10 and all(o.ok for o in outcomes)


async def _pending_is(tinker: Tinker, n: int) -> bool:
    return (await tinker.describe_coordinator())["pending"] == n


async def test_the_sampling_queue_counts_samples_and_tokens_not_calls(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    _, run = await tinker.ready_run(sid, 1)
    engine = tinker.engine
    held = await tinker.submit(run, tinker.fwd(1, hold=True))
    await engine.wait_for(lambda: any("hold" in fwd_flags(i) for i in engine.items))

    sampler = SamplerInfo(sampler_id=names.sampler_id_for(sid, 2), base_model=tinker.base_model)
    handle = await tinker.client.start_workflow(
        SampleRequestWorkflow.run,
        SampleStart(
            sampler=sampler, payloads=[blob("mem://w/0"), blob("mem://w/1")], samples=[3, 5], work=[3 * 10, 5 * 100]
        ),
        id=names.sample_workflow_id(sampler.sampler_id, body_hash("work")),
        task_queue=tinker.workflow_queue,
    )
    tinker.started.append(handle)
    # Two calls, eight samples, 530 tokens of work: the API's 429 decision reads the last two.
    described = await eventually(lambda: _described_with_pending(tinker, 2))
    assert (described["pending_samples"], described["pending_sample_tokens"]) == (8, 530)
    engine.release.set()
    assert (await within(held.result())).ok
    assert all(o.ok for o in await within(handle.result()))


async def _described_with_pending(tinker: Tinker, n: int) -> dict | None:
    described = await tinker.describe_coordinator()
    return described if described["pending"] == n else None
