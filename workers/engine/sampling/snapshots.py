"""Sampler snapshots held under a byte budget: least recently used first out (bounded by construction).

Every `save_weights_and_get_sampling_client` leaves an immutable LoRA snapshot on the worker. The coordinator
collects a run's older ones after they sit unused, which bounds them in time, not in memory: a client that makes
snapshots faster than they age out (an RL loop, with an 8B model at rank 32) would fill the accelerator. So the
engine keeps them in this cache, sized in bytes, and evicts the least recently sampled one when a new one would go
over. An evicted snapshot is paged out to the worker's page store (host memory, then files: runtime/paging_store.py)
and paged back in when a sampling batch names it. Only when the page budgets are full of training adapters is a
snapshot dropped: then saved weights (keys `tinker://…`) are reloaded from the checkpoint store on their next use,
and a request naming an ephemeral one fails with a message that says so (never a hang, never garbage).

`SamplerSnapshots` is the engine's record of them: taken from a training slot (a copy, so later training of the
slot cannot change it) or loaded from named weights, dropped, and stacked on a leading axis for a sampling batch
(`lora_stack`, the form the decode programs route rows into).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..model.lora import LORA_ALPHA
from ..runtime.aot_cache import abstract
from ..runtime.paging_store import Page, PageStore
from ..training.adapter_slots import leaf_name
from ..types import LoraConfig
from .buckets import STACK_SIZES, stack_size

if TYPE_CHECKING:
    from ..training.adapter_slots import AdapterSlots

log = logging.getLogger(__name__)
REMEMBERED_EVICTIONS = 65536  # keys remembered as evicted, for the clear error (bounded too)
DEFAULT_FRACTION = 0.10  # of device memory, when no budget is given


def snapshot_key(key: str) -> str:
    """The page-store key of a sampler snapshot (training runs' adapters have their own prefix)."""
    return f"snapshot:{key}"


def tree_bytes(tree: Any) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def default_budget_bytes() -> int:
    """A tenth of the first local device's memory (an accelerator's HBM; on CPU, the machine's RAM). Local: in a
    multi-host group jax.devices()[0] may belong to another process, and PjRt answers memory_stats only for
    addressable devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(limit * DEFAULT_FRACTION)


def evicted_message(key: str, budget_bytes: int) -> str:
    return (
        f"sampler weights {key!r} were evicted from this JAX worker's snapshot memory (budget "
        f"{budget_bytes / 2**20:,.0f} MiB, --snapshot-budget-mb; least recently used go first) and from its page "
        "store (full of training adapters: --adapter-host-memory-mb, --adapter-disk-mb) and cannot be "
        "reloaded: they were never saved under a name. Call save_weights_and_get_sampling_client again, or use "
        "save_weights_for_sampler(name) for weights that reload on demand"
    )


class SnapshotCache(OrderedDict):
    """key -> Snapshot, in least-recently-used order; inserting past `budget_bytes` evicts from the old end (the
    newest snapshot always stays, even alone over the budget). Reading a key marks it used."""

    def __init__(self, budget_bytes: int):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.sizes: dict[str, int] = {}
        self.evicted: OrderedDict[str, None] = OrderedDict()
        self.pinned: frozenset[str] = frozenset()  # a sampling batch's snapshots: never evicted while it runs
        self.on_evict: Callable[[str, Any], None] | None = None  # where an evicted snapshot goes (its page)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def __setitem__(self, key: str, snapshot: Any) -> None:
        super().__setitem__(key, snapshot)
        self.move_to_end(key)
        self.sizes[key] = tree_bytes(getattr(snapshot, "lora", snapshot))
        self.evicted.pop(key, None)
        while self.total_bytes > self.budget_bytes and len(self) > 1:
            old = next((k for k in self if k != key and k not in self.pinned), None)
            if old is None:
                break
            evicted = super().pop(old)
            freed = self.sizes.pop(old)
            if self.on_evict is not None:
                self.on_evict(old, evicted)
            self.evicted[old] = None
            while len(self.evicted) > REMEMBERED_EVICTIONS:
                self.evicted.popitem(last=False)
            log.info("evicted sampler snapshot %s (%d bytes) to stay under %d bytes", old, freed, self.budget_bytes)

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def pop(self, key: str, *default: Any) -> Any:
        self.sizes.pop(key, None)
        self.evicted.pop(key, None)  # dropped on purpose: no longer "evicted"
        return super().pop(key, *default)


@dataclass(frozen=True)
class Snapshot:
    lora: Any  # LoRA state without the adapter axis
    scale: float


class SamplerSnapshots:
    """key -> immutable Snapshot under the byte budget (`cache`), and the stacked LoRA of a sampling batch."""

    def __init__(self, slots: AdapterSlots, budget_bytes: int):
        self._slots = slots
        # 0: a tenth of the device's memory.
        self.cache = SnapshotCache(budget_bytes or default_budget_bytes())
        placement = slots.placement

        def stack(snaps, like, size):
            def one(slot_leaf, *leaves):
                zero = jnp.zeros(slot_leaf.shape[1:], slot_leaf.dtype)
                return jnp.stack([*leaves] + [zero] * (size - len(leaves)))

            return placement.constrain_params(jax.tree.map(one, like, *snaps))

        self._stack = jax.jit(stack, static_argnums=2)
        self._stack_cache: tuple[tuple, Any] | None = None
        # key -> how many times weights were put under it: an inflight target is re-taken under its one key, and
        # the prefix cache must not serve keys and values computed under the weights it had before.
        self._versions: dict[str, int] = {}
        self._pages: PageStore | None = None

    def version(self, key: str) -> int:
        return self._versions.get(key, 0)

    def __contains__(self, key: str) -> bool:
        return key in self.cache

    def __getitem__(self, key: str) -> Snapshot:
        return self.cache[key]  # marks it used

    def keys(self) -> set[str]:
        return set(self.cache)

    def take(self, slot: int, key: str) -> None:
        """Snapshot training slot `slot` as `key`."""
        self._slots.check_slot(slot)
        lora = self._slots.take_slot(self._slots.lora, np.int32(slot))  # a copy (see AdapterSlots.take_slot)
        self.cache[key] = Snapshot(lora=lora, scale=self._slots.scale(slot))
        self._versions[key] = self._versions.get(key, 0) + 1
        self._stack_cache = None

    def load(self, key: str, config: LoraConfig, weights: dict[str, np.ndarray]) -> None:
        """A snapshot from named weights (as AdapterSlots.named gives them; missing ones are zero), no slot involved."""
        self._slots.check_rank(config)
        full = self._slots.full(config, weights, "weights")
        # Through an adapter axis of one, so the snapshot is placed exactly as take() places one.
        lora = self._slots.take_slot(self._slots.put_lora(jax.tree.map(lambda x: x[None], full)), np.int32(0))
        self.cache[key] = Snapshot(lora=lora, scale=LORA_ALPHA / config.rank)
        self._versions[key] = self._versions.get(key, 0) + 1
        self._stack_cache = None

    def evicted(self, key: str) -> bool:
        """True when `key` was a snapshot here and the byte budget pushed it out of the device and the page store
        (saved weights reload on demand)."""
        paged = self._pages is not None and snapshot_key(key) in self._pages
        return key in self.cache.evicted and key not in self.cache and not paged

    def drop(self, key: str) -> None:
        self.cache.pop(key, None)
        if self._pages is not None:
            self._pages.drop(snapshot_key(key))
        self._stack_cache = None

    # ------------------------------------------------------------------ paging (runtime/paging_store.py)

    def attach_pages(self, pages: PageStore) -> None:
        """From now on a snapshot the device budget evicts is paged out to `pages` (host memory, then files) and
        paged back in when a sampling batch names it, instead of being lost."""
        self._pages = pages
        self.cache.on_evict = self._page_out

    def _page_out(self, key: str, snapshot: Snapshot) -> None:
        assert self._pages is not None
        leaves = jax.tree_util.tree_flatten_with_path(self._slots.placement.to_host(snapshot.lora))[0]
        arrays = {leaf_name(path): np.asarray(x) for path, x in leaves}
        self._pages.put(snapshot_key(key), Page(kind="snapshot", arrays=arrays, meta={"scale": snapshot.scale}))

    @contextlib.contextmanager
    def paged_in(self, keys: Iterable[str]) -> Iterator[None]:
        """Within the block, every snapshot of `keys` that was paged out is back on the device and none of `keys`
        is evicted (one sampling batch decodes them together, whatever the budget)."""
        wanted = frozenset(keys)
        self.cache.pinned = wanted
        try:
            self._page_in(wanted)
            yield
        finally:
            self.cache.pinned = frozenset()

    def _page_in(self, wanted: frozenset[str]) -> None:
        if self._pages is None:
            return
        for key in sorted(wanted):
            if key in self.cache or snapshot_key(key) not in self._pages:
                continue
            page = self._pages.take(snapshot_key(key))
            arrays = page.arrays
            host = jax.tree_util.tree_map_with_path(
                lambda path, _leaf, arrays=arrays: arrays[leaf_name(path)][None], self._slots.lora
            )  # one adapter axis of one, placed as take() places a snapshot
            lora = self._slots.take_slot(self._slots.put_lora(host), np.int32(0))
            self.cache[key] = Snapshot(lora=lora, scale=float(page.meta["scale"]))
            self._stack_cache = None
            log.debug("paged sampler snapshot %s back in", key)

    def lora_stack(self, keys: tuple[str, ...]) -> Any:
        """The snapshots' LoRA state stacked on a leading axis [len(keys) padded to its stack size (buckets.py)]."""
        assert len(keys) <= STACK_SIZES[-1], "sample_requests splits a call over more snapshots than a stack holds"
        if self._stack_cache is not None and self._stack_cache[0] == keys:
            return self._stack_cache[1]
        stacked = self._stack(tuple(self.cache[k].lora for k in keys), self._slots.lora, stack_size(len(keys)))
        self._stack_cache = (keys, stacked)
        return stacked

    def zero_stack(self, snapshots: int) -> Any:
        """The stack a batch of this many distinct snapshots runs with, of zero adapters, shaped like a real one: for
        compiling ahead of traffic."""
        return self._stack((), self._slots.lora, stack_size(snapshots))

    def stack_spec(self, snapshots: int) -> Any:
        """`zero_stack`'s shapes and shardings, from the slots' shapes alone: nothing runs or is read, so it is safe
        beside a call that donates the slots."""
        return self._stack.lower((), abstract(self._slots.lora), stack_size(snapshots)).compile().out_info
