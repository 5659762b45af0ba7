"""The prefix KV cache: keys and values of prompt blocks already prefilled, kept on the device for prompts that
start the same way (the samples of one GRPO group, the turns of one conversation).

The device side is one pool of `blocks` blocks of `BLOCK` tokens, [layers, blocks, BLOCK, kv_heads, head_dim] keys
and values in the compute dtype, a fixed size counted in the device-memory plan (`--prefix-cache-tokens`): bounded by
construction. An admission gathers a row's cached blocks into its prompt buffer and prefills only the rest of the
prompt, its queries attending to the gathered keys (`decode.admit`); then it writes the prompt's new whole blocks to
the pool.

The host side, `PrefixIndex`, says which pool block holds what. A block is known by its namespace, its parent block
(the one before it in the prompt, -1 for the first) and its own tokens, so two prompts share a block only when
everything before it is the same too: exact, with no hash that could collide. A namespace is one sampling session
under one version of its weights (`sample_requests.py`): a cached block is never read by another session, another
tenant or other weights, so caching changes no number anyone sees. Blocks are evicted least recently used first;
every use touches a prompt's blocks from its last to its first, so a parent is always more recent than its children
and the oldest block is always a leaf: evicting it never orphans another.

A prompt with images holds placeholder tokens that are the same for every image of a grid size, so a block that
holds any of an image's placeholders also keys on that image's digest (`ImageSpan`: the placeholders' token range
and a digest of the image's bytes): the same tokens with another image never hit, and every block after it differs
through its parent.

A model with recurrent layers (Gated DeltaNet: `model/slot_cache.py`) resumes after a cached prefix only from each
such layer's state at the prefix's end. The pool keeps those states too, as snapshots beside the blocks: a snapshot
is the linear layers' (conv, recurrent) state after a block's last token, taken when an admission prefills up to
that block's end, held in one of a fixed number of state slots (`state_slots`: one per STATE_EVERY blocks, counted
in the memory plan), keyed by the block it follows (so by namespace and every token before it, as the block) and
freed with it. A hit on such a model is the longest cached run of blocks whose last one has a snapshot. A row
snapshots the block boundary a prompt like it resumes from: the last one before its last token (the samples of one
request, a longer next turn). When every state slot is taken, the least recently used block's snapshot gives way
(the block itself stays, a parent of others; it is just no longer a place to resume from).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

from ..shape_buckets import BLOCK, STATE_EVERY, state_slots

__all__ = ["BLOCK", "STATE_EVERY", "ImageSpan", "PrefixIndex", "state_slots"]

ImageSpan = tuple[int, int, bytes]  # [start, end) of one image's placeholder tokens in the prompt, its bytes' digest
BlockKey = tuple[Hashable, int, tuple[int, ...], tuple[bytes, ...]]  # namespace, parent, tokens, images' digests


class PrefixIndex:
    """Which pool block holds which prompt block (module docstring). Host-only, one thread at a time."""

    def __init__(self, blocks: int, states: int = 0):
        self.blocks = blocks
        self.states = states  # state-snapshot slots (0: a model of keys and values only, nothing to resume)
        self._state: dict[int, int] = {}  # block -> the state slot of its snapshot
        self._free_states = list(range(states - 1, -1, -1))
        self._where: dict[BlockKey, int] = {}  # (namespace, parent, tokens, image digests) -> block
        self._key: dict[int, BlockKey] = {}  # block -> its key
        self._children: dict[int, int] = {}  # block -> how many cached blocks follow it
        self._lru: OrderedDict[int, None] = OrderedDict()  # used blocks, least recently used first
        self._free = list(range(blocks - 1, -1, -1))
        self.hits = 0  # tokens served from the cache, since start (admission.plan counts what it reads)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._key)

    def lookup(
        self, namespace: Hashable, prompt: np.ndarray, limit: int, images: Sequence[ImageSpan] = ()
    ) -> list[int]:
        """The pool blocks holding the longest cached run of `prompt`'s whole blocks, at most `limit` tokens' worth
        (the caller keeps the rest for itself: at least the last token, whose logits it samples from)."""
        found: list[int] = []
        parent = -1
        for b in range(min(len(prompt), max(0, limit)) // BLOCK):
            block = self._where.get((namespace, parent, _tokens(prompt, b), _digests(images, b)))
            if block is None:
                break
            found.append(block)
            parent = block
        if self.states:  # a recurrent model resumes only where a snapshot is
            while found and found[-1] not in self._state:
                found.pop()
        self._touch(found)
        return found

    def state_of(self, block: int) -> int:
        """The state slot of the snapshot after `block` (a block `lookup` returned last)."""
        return self._state[block]

    def plan_state(self, block: int, pinned: set[int]) -> int:
        """A state slot for the snapshot after `block` (one `plan_writes` just registered), or -1: none could be
        freed without taking a `pinned` block's. Registered now, as the block."""
        if block in self._state:
            return -1
        if not self._free_states:
            victim = next((b for b in self._lru if b in self._state and b not in pinned), None)
            if victim is None:
                return -1
            self._free_states.append(self._state.pop(victim))
        self._state[block] = slot = self._free_states.pop()
        return slot

    def plan_writes(
        self,
        namespace: Hashable,
        prompt: np.ndarray,
        cached: list[int],
        pinned: set[int],
        images: Sequence[ImageSpan] = (),
    ) -> list[int]:
        """Pool blocks to write `prompt`'s whole blocks after the `cached` ones into (one entry per block of the
        prompt from len(cached) on; -1 where nothing is written: no block could be freed without evicting a
        `pinned` one, which this admission reads). Registered now: the admission that writes them runs before any
        later one reads them."""
        out: list[int] = []
        parent = cached[-1] if cached else -1
        chain = list(cached)
        for b in range(len(cached), len(prompt) // BLOCK):
            key = (namespace, parent, _tokens(prompt, b), _digests(images, b))
            block = self._where.get(key)
            if block is not None:  # another row of this admission writes it: written once, read next time
                out.append(-1)
            else:
                block = self._allocate(pinned | set(chain))
                if block is None:
                    break
                self._where[key], self._key[block] = block, key
                self._children[block] = 0
                if parent >= 0:
                    self._children[parent] += 1
                out.append(block)
            chain.append(block)
            parent = block
        self._touch(chain)
        return out

    def _touch(self, chain: list[int]) -> None:
        for block in reversed(chain):  # the last block first, so parents end up more recent than their children
            self._lru[block] = None
            self._lru.move_to_end(block)

    def _allocate(self, pinned: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for block in self._lru:  # least recently used first: a leaf (module docstring)
            if block not in pinned and self._children.get(block, 0) == 0:
                self._evict(block)
                return block
        return None

    def _evict(self, block: int) -> None:
        key = self._key.pop(block)
        del self._where[key]
        del self._lru[block]
        self._children.pop(block, None)
        if block in self._state:
            self._free_states.append(self._state.pop(block))
        if key[1] >= 0:
            self._children[key[1]] -= 1
        self.evictions += 1


def _tokens(prompt: np.ndarray, b: int) -> tuple[int, ...]:
    return tuple(int(t) for t in prompt[b * BLOCK : (b + 1) * BLOCK])


def _digests(images: Sequence[ImageSpan], b: int) -> tuple[bytes, ...]:
    """The digests of the images with a placeholder in block `b`, in prompt order."""
    lo, hi = b * BLOCK, (b + 1) * BLOCK
    return tuple(digest for start, end, digest in images if start < hi and end > lo)
