"""A training slot's whole state off the device and back, bit for bit: how more runs than slots share a worker.

A run's adapter is its slot's slice of four LoRA-shaped trees (weights, gradient accumulator, AdamW mu and nu) and
its AdamW step count. Paging out copies exactly those slices to the host (one jitted slice, one transfer) as a
`Page` in the engine's `PageStore` and frees the slot; paging in writes them back into a free slot (one jitted
write, in place on the donated trees) and restores the slot's `LoraConfig`. Nothing is trimmed, cast or recomputed,
so a run paged out and back continues exactly as one that stayed resident, in whatever slot it lands (tests/engine/
test_adapter_paging.py checks losses and weights for equality, not closeness). The gradient accumulator is copied
only when it holds something (between a forward_backward and its optim_step); otherwise the slot's zeros are
written back. Which runs are resident is the Coordinator's decision (workflows/coordinator/paging.py); this module only
moves what it is told to.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.paging_store import Page, PageStore
from ..types import InputError, LoraConfig, PageMoves, PageReport
from .adapter_slots import AdapterSlots, leaf_name
from .optimizer import OptState, put_slot, take_slot

log = logging.getLogger(__name__)
TREES = ("lora", "grads", "mu", "nu")


def adapter_key(model_key: str) -> str:
    """The page-store key of a training run's adapter (snapshots have their own prefix)."""
    return f"adapter:{model_key}"


class AdapterPager:
    """Moves slots of `slots` to and from `store` (see the module doc)."""

    def __init__(self, slots: AdapterSlots, store: PageStore):
        self.slots = slots
        self.store = store
        placement = slots.placement
        leaves = jax.tree_util.tree_flatten_with_path(slots.lora)[0]
        self._names = [leaf_name(path) for path, _ in leaves]
        per_slot = sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize for _, x in leaves)
        # The largest page: all four trees (the accumulator holding gradients) and the step count.
        self.page_bytes = len(TREES) * per_slot + np.dtype(np.int32).itemsize

        def take(lora, grads, opt, slot):
            one = lambda tree: [take_slot(x, slot) for x in jax.tree.leaves(tree)]  # noqa: E731
            g = one(grads)
            dirty = jnp.any(jnp.stack([jnp.any(x != 0) for x in g]))  # NaN counts as something: kept exactly
            return one(lora), one(opt.mu), one(opt.nu), take_slot(opt.count, slot), dirty, g

        def put(lora, grads, opt, slot, values, count, *, with_grads: bool):
            w, g, mu, nu = values

            def into(tree, leaves):
                flat, treedef = jax.tree.flatten(tree)
                if leaves is None:
                    leaves = [jnp.zeros(x.shape[1:], x.dtype) for x in flat]
                return jax.tree.unflatten(treedef, [put_slot(x, slot, v) for x, v in zip(flat, leaves, strict=True)])

            lora, grads = into(lora, w), into(grads, g if with_grads else None)
            mu, nu = into(opt.mu, mu), into(opt.nu, nu)
            count = jax.lax.with_sharding_constraint(put_slot(opt.count, slot, count), placement.replicated)
            lora, grads, mu, nu = (placement.constrain_params(t) for t in (lora, grads, mu, nu))
            return lora, grads, OptState(mu=mu, nu=nu, count=count)

        self._take = jax.jit(take)
        self._put = jax.jit(put, static_argnames=("with_grads",), donate_argnums=(0, 1, 2))

    @property
    def capacity(self) -> int:
        """Adapters the store holds beside the slots: its budgets over the largest page."""
        return self.store.capacity(self.page_bytes)

    def move(self, moves: PageMoves) -> PageReport:
        """Every page-out, then every page-in, then the drops (Engine.page). A move that fails leaves that adapter
        lost on this worker, its slot free, and is named in the report; the others go on."""
        failed: dict[str, str] = {}
        out_s, in_s, tiers = [], [], []
        for slot, key in moves.page_out:
            try:
                out_s.append(self.page_out(slot, key))
            except Exception as e:  # PagesFull, a storage fault: that run restores itself from its snapshot
                log.exception("paging out %s from slot %d failed", key, slot)
                failed[key] = f"paging its adapter out failed: {e}"
        for key, slot in moves.page_in:
            try:
                seconds, tier = self.page_in(key, slot)
            except Exception as e:
                log.exception("paging in %s to slot %d failed", key, slot)
                failed[key] = f"paging its adapter in failed: {e}"
                continue
            in_s.append(seconds)
            tiers.append(tier)
        for key in moves.drop:
            self.drop(key)
        return PageReport(
            failed=failed,
            out_seconds=tuple(out_s),
            in_seconds=tuple(in_s),
            in_tiers=tuple(tiers),
            resident=len(self.slots.configs),
            paged=len(self.store.keys("adapter")),
            host_bytes=self.store.host_bytes,
            disk_bytes=self.store.disk_bytes,
        )

    # ------------------------------------------------------------------ out

    def page_out(self, slot: int, key: str) -> float:
        """Copy slot `slot` to the store as `key` and free the slot; the seconds it took. On any failure the slot
        is freed all the same (the caller reports the adapter lost: its run restores it from its snapshot)."""
        s = self.slots
        s.check_slot(slot)
        started = time.perf_counter()
        try:
            config = s.configs[slot]
            lora, mu, nu, count, dirty, grads = self._take(s.lora, s.grads, s.opt, np.int32(slot))
            lora, mu, nu, count, dirty = s.placement.to_host((lora, mu, nu, count, dirty))
            arrays = self._named("lora", lora) | self._named("mu", mu) | self._named("nu", nu)
            if bool(dirty):
                arrays |= self._named("grads", s.placement.to_host(grads))
            meta = {"config": dataclasses.asdict(config), "count": int(count)}
            self.store.put(adapter_key(key), Page(kind="adapter", arrays=arrays, meta=meta))
        finally:
            s.free(slot)
        return time.perf_counter() - started

    def _named(self, tree: str, leaves: list[Any]) -> dict[str, np.ndarray]:
        return {f"{tree}/{name}": np.asarray(x) for name, x in zip(self._names, leaves, strict=True)}

    # ------------------------------------------------------------------ in

    def page_in(self, key: str, slot: int) -> tuple[float, str]:
        """Write `key`'s page into the free slot `slot`; (seconds, the tier it came from: host or disk)."""
        s = self.slots
        s.check_slot(slot, allocated=False)
        if slot in s.configs:
            raise InputError(f"adapter slot {slot} holds another adapter; page it out first")
        started = time.perf_counter()
        tier = self.store.where(adapter_key(key))
        if not tier:
            raise KeyError(f"no paged-out adapter {key!r} on this worker")
        page = self.store.take(adapter_key(key))
        try:
            config = LoraConfig(**page.meta["config"])
            values = tuple(
                [page.arrays[f"{tree}/{name}"] for name in self._names]
                if f"{tree}/{self._names[0]}" in page.arrays
                else None
                for tree in TREES
            )
            with_grads = values[1] is not None
            count = np.int32(page.meta["count"])
            s.lora, s.grads, s.opt = self._put(
                s.lora, s.grads, s.opt, np.int32(slot), values, count, with_grads=with_grads
            )
            jax.block_until_ready(s.opt.count)  # the seconds reported are the copy's, not its dispatch's
        except BaseException:
            self.store.put(adapter_key(key), page)  # not written: the page stays where the run will look for it
            raise
        s.configs[slot] = config
        return time.perf_counter() - started, tier

    def drop(self, key: str) -> bool:
        return self.store.drop(adapter_key(key))
