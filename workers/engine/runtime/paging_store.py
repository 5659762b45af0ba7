"""Where adapters and sampler snapshots live while they are off the device: host memory, then files.

The device holds `max_lora_adapters` training slots and a byte-budgeted set of sampler snapshots; everything else a
worker serves is paged out here. A `Page` is named arrays (the exact float32 bits of what left the device) plus a
small JSON-able `meta`. Pages go to host memory first; past the host budget the least recently paged-out move to
files under `spill_url` (fsspec: the checkpoint store's `file://` directory or `gs://` bucket), up to the disk
budget. Taking a page back removes it from whichever tier holds it: a page has one home at a time.

Two kinds, with different guarantees:

- **adapter** (a training run's LoRA weights, gradient accumulator, AdamW moments and step): never dropped. The
  Coordinator admits no more runs than `capacity(page_bytes)` pages beside the slots, so an adapter always has room;
  if it somehow has not, `put` raises `PagesFull` and stores nothing.
- **snapshot** (sampler weights pushed out of the device's snapshot budget): dropped, least recently used first,
  when an adapter or a newer snapshot needs the room, and then answered as evicted (see sampling/snapshots.py).

Files are `.npz` (numpy's own container, uncompressed: bit-exact and no decoding cost) named by a hash of the key, in
a directory this worker owns: it is emptied when the store is made, since a restarted worker's Coordinator has
forgotten what its predecessor paged out. Calls come from the engine's one thread; nothing here is thread-safe.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

Kind = Literal["adapter", "snapshot"]
_META = "__meta__"


def default_host_budget_bytes(cap_bytes: int = 0) -> int:
    """A quarter of the machine's memory, or of `cap_bytes` when that is smaller (--device-memory-gb: on CPU the
    device is the host, and a capped worker keeps its pages inside the cap): the JAX worker's default
    (--adapter-host-memory-mb)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 16 * 2**30
    return (min(memory, cap_bytes) if cap_bytes > 0 else memory) // 4


class PagesFull(RuntimeError):
    """An adapter page found no room in host memory or on disk (the budgets are full of other adapters)."""


@dataclass(frozen=True)
class Page:
    kind: Kind
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict[str, Any])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


@dataclass(frozen=True)
class _OnDisk:
    kind: Kind
    nbytes: int
    path: str


@dataclass
class PageCounts:
    """Totals since the store was made, and where the pages are now (for metrics and the benchmark)."""

    host_pages: int = 0
    host_bytes: int = 0
    disk_pages: int = 0
    disk_bytes: int = 0
    spilled: int = 0  # pages moved from host memory to files
    dropped: int = 0  # snapshot pages dropped for room
    read_from_disk: int = 0


class PageStore:
    """Pages by key in two tiers under byte budgets (see the module doc). `spill_url` "" keeps host memory only."""

    def __init__(self, host_budget_bytes: int, disk_budget_bytes: int = 0, spill_url: str = ""):
        self.host_budget = max(0, int(host_budget_bytes))
        self.disk_budget = max(0, int(disk_budget_bytes)) if spill_url else 0
        self.spill_url = spill_url
        self._host: OrderedDict[str, Page] = OrderedDict()  # least recently paged out first
        self._disk: OrderedDict[str, _OnDisk] = OrderedDict()
        self.counts = PageCounts()
        self._fs: Any = None
        self._root = ""
        if spill_url:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(spill_url)
            if self._fs.exists(self._root):
                self._fs.rm(self._root, recursive=True)  # a predecessor's pages: nobody will ask for them
            self._fs.makedirs(self._root, exist_ok=True)

    # ------------------------------------------------------------------ sizes

    def capacity(self, page_bytes: int) -> int:
        """How many pages of `page_bytes` (the largest an adapter's can be) the two budgets hold together."""
        if page_bytes <= 0:
            return 0
        return self.host_budget // page_bytes + self.disk_budget // page_bytes

    def __contains__(self, key: str) -> bool:
        return key in self._host or key in self._disk

    def __len__(self) -> int:
        return len(self._host) + len(self._disk)

    def where(self, key: str) -> str:
        return "host" if key in self._host else "disk" if key in self._disk else ""

    def keys(self, kind: Kind | None = None) -> list[str]:
        host = [k for k, p in self._host.items() if kind is None or p.kind == kind]
        return host + [k for k, d in self._disk.items() if kind is None or d.kind == kind]

    @property
    def host_bytes(self) -> int:
        return self.counts.host_bytes

    @property
    def disk_bytes(self) -> int:
        return self.counts.disk_bytes

    # ------------------------------------------------------------------ pages in and out

    def put(self, key: str, page: Page) -> None:
        """Keep `page` as `key` (replacing any page of that key). Raises PagesFull (storing nothing) when an adapter
        page fits nowhere; a snapshot page that fits nowhere is dropped (counted, logged)."""
        self.drop(key)
        size = page.nbytes
        if size <= self.host_budget and self._room_on_host(size):
            self._host[key] = page
            self._count_host(page, +1)
            return
        if self._room_on_disk(size, page.kind):
            self._write(key, page)
            return
        if page.kind == "snapshot":
            self.counts.dropped += 1
            log.info("sampler snapshot %s (%d bytes) dropped: no room in the page budgets", key, size)
            return
        raise PagesFull(
            f"no room to page out adapter {key} ({size / 2**20:.1f} MiB): host memory holds "
            f"{self.counts.host_bytes / 2**20:.0f} of {self.host_budget / 2**20:.0f} MiB "
            f"(--adapter-host-memory-mb) and files {self.counts.disk_bytes / 2**20:.0f} of "
            f"{self.disk_budget / 2**20:.0f} MiB (--adapter-disk-mb), all adapters"
        )

    def take(self, key: str) -> Page:
        """The page of `key`, removed from its tier. KeyError when there is none."""
        page = self._host.pop(key, None)
        if page is not None:
            self._count_host(page, -1)
            return page
        entry = self._disk.pop(key)
        try:
            with self._fs.open(entry.path, "rb") as f:
                data = f.read()
        except BaseException:
            self._disk[key] = entry  # still there; a later take may succeed
            raise
        self._count_disk(entry, -1)
        self._remove_file(entry.path)
        self.counts.read_from_disk += 1
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files if name != _META}
            meta = json.loads(bytes(npz[_META]).decode())
        return Page(kind=entry.kind, arrays=arrays, meta=meta)

    def drop(self, key: str) -> bool:
        """Forget `key`'s page wherever it is; True when there was one."""
        page = self._host.pop(key, None)
        if page is not None:
            self._count_host(page, -1)
            return True
        entry = self._disk.pop(key, None)
        if entry is None:
            return False
        self._count_disk(entry, -1)
        self._remove_file(entry.path)
        return True

    # ------------------------------------------------------------------ making room

    def _room_on_host(self, size: int) -> bool:
        """Spill (then drop snapshots) until `size` more bytes fit the host budget; False if it cannot."""
        while self.counts.host_bytes + size > self.host_budget:
            if not self._host:
                return False
            oldest = next(iter(self._host))
            victim = self._host[oldest]
            if self._room_on_disk(victim.nbytes, victim.kind):
                del self._host[oldest]
                self._count_host(victim, -1)
                self._write(oldest, victim)
                self.counts.spilled += 1
                continue
            # Nothing more fits on disk: a snapshot in host memory may make way (for an adapter, or a newer one).
            snap = next((k for k, p in self._host.items() if p.kind == "snapshot"), None)
            if snap is None:
                return False
            self._count_host(self._host.pop(snap), -1)
            self.counts.dropped += 1
            log.info("sampler snapshot %s dropped from host memory to make room", snap)
        return True

    def _room_on_disk(self, size: int, kind: Kind) -> bool:
        """Drop snapshot files, oldest first, until `size` more bytes fit the disk budget; False if they cannot."""
        if size > self.disk_budget:
            return False
        while self.counts.disk_bytes + size > self.disk_budget:
            snap = next((k for k, d in self._disk.items() if d.kind == "snapshot"), None)
            if snap is None:
                return False
            self.drop(snap)
            self.counts.dropped += 1
            log.info("sampler snapshot %s dropped from disk to make room for a %s page", snap, kind)
        return True

    # ------------------------------------------------------------------ files

    def _write(self, key: str, page: Page) -> None:
        started = time.perf_counter()
        path = f"{self._root}/{hashlib.sha256(key.encode()).hexdigest()[:40]}.npz"
        buffer = io.BytesIO()
        contents: dict[str, Any] = {**page.arrays, _META: np.frombuffer(json.dumps(page.meta).encode(), np.uint8)}
        np.savez(buffer, **contents)
        with self._fs.open(path, "wb") as f:
            f.write(buffer.getbuffer())
        entry = _OnDisk(kind=page.kind, nbytes=page.nbytes, path=path)
        self._disk[key] = entry
        self._count_disk(entry, +1)
        log.debug("paged %s to %s (%d bytes) in %.3fs", key, path, entry.nbytes, time.perf_counter() - started)

    def _remove_file(self, path: str) -> None:
        try:
            self._fs.rm(path)
        except FileNotFoundError:
            pass

    def _count_host(self, page: Page, sign: int) -> None:
        self.counts.host_pages += sign
        self.counts.host_bytes += sign * page.nbytes

    def _count_disk(self, entry: _OnDisk, sign: int) -> None:
        self.counts.disk_pages += sign
        self.counts.disk_bytes += sign * entry.nbytes
