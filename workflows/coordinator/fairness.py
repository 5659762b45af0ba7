"""How the Coordinator shares its workers between tenants: queued work is taken round-robin over sessions.

Workflow code (deterministic, stdlib only): the order depends only on the queue's contents.
"""

from __future__ import annotations

from tinkerflow.workflows.protocol.messages import WorkItem


def growing(order: list[WorkItem], source: list[WorkItem], queued: int):
    """Iterate `order`, then whatever routing appended to `source` meanwhile (snapshot collection queues its drops
    there), as iterating `source` itself would."""
    i = 0
    while i < len(order):
        yield order[i]
        i += 1
        if order is not source and len(source) > queued:
            order.extend(source[queued:])
            queued = len(source)


def tenant_of(item: WorkItem) -> str:
    """The session an item serves (a run's model_id starts with its session id); the requester when unknown."""
    if item.session_id:
        return item.session_id
    if ":" in item.model_id:
        return item.model_id.split(":", 1)[0]
    return item.requester.split("#", 1)[0]


def fair_order(items: list[WorkItem]) -> list[WorkItem]:
    """Round-robin over tenants, each tenant's items in arrival order; tenants in order of their oldest item.

    Order within a tenant is kept, so a run's ops (and a load before its sample) stay in sequence."""
    queues: dict[str, list[WorkItem]] = {}
    for item in items:
        queues.setdefault(tenant_of(item), []).append(item)
    ordered: list[WorkItem] = []
    depth = 0
    while len(ordered) < len(items):
        for q in queues.values():
            if depth < len(q):
                ordered.append(q[depth])
        depth += 1
    return ordered
