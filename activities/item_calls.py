"""How `run_batch` turns work items into engine calls and their outcomes: one item per call, or a run of grouped
items decoded and run as ONE engine call; bad input fails its own item as `user`, and a call that raised fails its
whole run with a message that says whether the engine or a store was at fault."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from tinkerflow.common.checkpoints import CheckpointError
from tinkerflow.common.storage_faults import storage_fault
from tinkerflow.workers.engine.types import InputError
from tinkerflow.workflows.protocol.messages import BlobRef, Outcome, WorkItem, WorkKind

# A grouped kind's decoded engine input and the engine's result for it (`one_engine_call`).
In = TypeVar("In")
Res = TypeVar("Res")


def single(handle: Callable[[WorkItem], Outcome]) -> Callable[[list[WorkItem]], list[Outcome]]:
    """A handler of one item; bad input (or a checkpoint that cannot be used) fails that item as `user`."""

    def run(items: list[WorkItem]) -> list[Outcome]:
        (item,) = items
        try:
            return [handle(item)]
        except (InputError, CheckpointError) as e:
            return [Outcome.failed(str(e), "user")]

    return run


def one_engine_call(
    items: list[WorkItem],
    decode: Callable[[WorkItem], In],
    run: Callable[[list[In]], list[Res | InputError]],
    encode: Callable[[In, Res], Outcome],
) -> list[Outcome]:
    """Decode each item (a bad one fails alone), run the rest in ONE engine call, encode each answer."""
    outcomes: list[Outcome | None] = [None] * len(items)
    inputs: list[In] = []
    positions: list[int] = []
    for n, item in enumerate(items):
        try:
            inputs.append(decode(item))
            positions.append(n)
        except InputError as e:
            outcomes[n] = Outcome.failed(str(e), "user")
    results: list[Res | InputError] = run(inputs) if inputs else []
    for n, inp, res in zip(positions, inputs, results):
        if isinstance(res, Exception):
            outcomes[n] = Outcome.failed(str(res), "user" if isinstance(res, InputError) else "server")
        else:
            outcomes[n] = encode(inp, res)
    # Every position is filled: by its failed decode, or by the engine's one result per input.
    return cast(list[Outcome], outcomes)


def failure_message(kind: WorkKind, error: Exception, store: tuple[str, str]) -> tuple[str, str]:
    """(what the run's requesters are told, what the log says) when running a run of `kind` raised. `store`: (which
    store the kind uses, its url): a storage fault names it and why, not an internal path."""
    fault = storage_fault(error)
    if not fault:
        return f"engine error in {kind}: {error}", ""
    which, url = store
    message = (
        f"{kind} failed: the {which} store ({url}) refused it: {fault}. A server-side "
        "storage fault: the operator must free or fix that storage"
    )
    return message, f"the {which} store {url} refused: {fault} ({error})"


def payload(item: WorkItem) -> BlobRef:
    assert item.payload is not None, f"{item.kind} work item {item.key} has no payload"  # the API always sends one
    return item.payload
