"""The train phase's multi-tenant figure: 8 runs, each its own adapter and its own data of mixed lengths, submitted
as one engine call (the JAX worker's batch path: activities/engine_activities.py turns consecutive forward_backward
items of several model ids into one `Engine.forward_backward` of one ForwardBackwardInput per item), against one
run on one adapter with the very same datums (same total tokens, same lengths) in one call.

The older `eight_adapters_cost` comparison put one datum of the same length per row in both layouts, so both ran
one compiled program of the same shape and its ratio held by construction. Here the tenants' datums keep their own
lengths and the engine packs them as it would in service, by adapter (training/steps.py), so what multi-tenancy
costs in padding, rows and programs shows in `tenants_ratio`. The same 8 runs as 8 calls, one after another, give
`sequential_ratio`: what batching saves.
"""

from __future__ import annotations

from benchmarks.device_phases.measure import emit

TENANTS = 8


def tenant_lengths(rng, tokens_per_tenant: int, shortest: int) -> list[int]:
    """Datum lengths of one tenant, drawn between `shortest` and 4x it, summing to `tokens_per_tenant`."""
    out: list[int] = []
    left = tokens_per_tenant
    while left > 0:
        n = min(left, int(rng.integers(shortest, 4 * shortest + 1)))
        if left - n < shortest and left - n > 0:
            n = left  # no datum shorter than `shortest` at the end
        out.append(n)
        left -= n
    return out


def phase_tenants(model, tokens: int, seed: int = 7) -> None:
    """`model` is a ModelPhases; `tokens` the total of every tenant's datums together."""
    import numpy as np

    from tinkerflow.workers.engine.types import ForwardBackwardInput

    rng = np.random.default_rng(seed)
    per_tenant = [
        model.data_of(tenant_lengths(rng, tokens // TENANTS, max(8, tokens // 128)), seed + t) for t in range(TENANTS)
    ]
    everyone = [d for data in per_tenant for d in data]
    tenants = [ForwardBackwardInput(slot=t, data=data, loss_fn="cross_entropy") for t, data in enumerate(per_tenant)]
    one_run = [ForwardBackwardInput(slot=0, data=everyone, loss_fn="cross_entropy")]
    repeats = 2 if model.smoke else 3
    s_one = min(model.fb_seconds(one_run, repeats)[1:])
    s_tenants = min(model.fb_seconds(tenants, repeats)[1:])
    s_sequential = sum(min(model.fb_seconds([r], repeats)[1:]) for r in tenants)
    emit(
        phase="train",
        figure="tenants",
        tenants=TENANTS,
        tokens=sum(len(d.tokens) for d in everyone),
        datums=len(everyone),
        datums_per_tenant=[len(d) for d in per_tenant],
        one_run_s=round(s_one, 4),
        tenants_s=round(s_tenants, 4),
        sequential_s=round(s_sequential, 4),
        tenants_ratio=round(s_tenants / s_one, 3),
        sequential_ratio=round(s_sequential / s_one, 3),
        ratio_is="step seconds over the one run's (same datums on one adapter, one call); min of the repetitions",
    )
