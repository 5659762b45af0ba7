"""The device-memory plan: what this worker's memory holds, and how much work fits in the rest.

Made once at start, after the weights and adapter slots are on the device, from what the device says it has
(`memory_stats()`: the allocator's limit and what is in use) or, on CPU, from the host's memory (or the
`--device-memory-gb` flag, which also caps an accelerator's). The fixed part is what is resident: base weights,
every slot's LoRA weights, gradient accumulator and Adam moments, the sampler-snapshot budget, the sampler's prefix
KV cache (its pool of prompt blocks, a fixed number of tokens of KV, and on a model with linear-attention layers its
fixed number of state snapshots), and a reserve for the runtime and compiled
programs. The rest, `work_bytes`, is shared in time by whatever op runs (the engine runs one op
at a time): a forward_backward's activations, a sampling call's KV cache and prefill.

Per-token costs are computed from the model's shape (the formulas below, checked in tests against what XLA reports
for the compiled programs): a training token's cost depends on its micro-batch's gradient checkpointing
(model/remat.py): without it every layer's intermediates; at DOTS one float32 hidden state and the saved matmul
outputs per layer; at FULL one float32 hidden state per layer; each besides the recomputed layer's intermediates. A
micro-batch takes the least recomputation that fits (`remat_for`); a KV-cache token keeps keys and values of every
layer in the compute dtype, and a model with linear-attention layers adds each decode slot's fixed-size recurrent
state. Work is admitted against it: a datum that can never fit is a user error before anything is allocated, naming
the limit in tokens and the flags that move it; a sampling call's decode slots and prefill rows are sized so they
fit (rows that do not fit now wait for a free slot).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np

from ..model.families import ModelConfig, family_named
from ..model.layer_costs import saved_matmul_bytes
from ..model.logprobs import chunk_tokens
from ..model.remat import Remat
from ..model.slot_cache import state_bytes_per_slot
from ..shape_buckets import BLOCK, round_down_seq_len, state_slots

log = logging.getLogger(__name__)

GIB = 2**30
# Kept free for the runtime, compiled programs and fragmentation: this share of the capacity, at least RESERVE_MIN.
RESERVE_SHARE = 0.08
RESERVE_MIN = GIB // 2
# A training micro-batch's activations are planned within this share of the work memory (the rest is headroom for
# XLA's temporaries beyond the estimate: fusion buffers, the attention tiles, transposes).
TRAIN_SHARE = 0.9
# A micro-batch keeps every layer's activations (Remat.NONE), or failing that its matmul outputs (Remat.DOTS), while
# they stay within this share of the work memory; past both it recomputes whole layers (Remat.FULL).
NO_REMAT_SHARE = 0.25
# A decode slot's buffers per cache position besides its KV: the token and its logprob, and room for the 20 top
# tokens and their logprobs (sampling/decode.py: MAX_TOPK_SAMPLE_LOGPROBS).
SLOT_BUFFER_BYTES_PER_TOKEN = 8 + 8 * 20
FLAGS = "--device-memory-gb (TINKERFLOW_DEVICE_MEMORY_GB), --max-lora-adapters, --max-lora-rank, --snapshot-budget-mb"


@dataclass(frozen=True)
class MemoryPlan:
    device: str  # what the capacity is the memory of
    capacity_bytes: int
    resident_bytes: int  # weights, adapter slots (weights, gradients, Adam moments): in use when the plan was made
    snapshot_bytes: int  # the sampler-snapshot budget
    reserve_bytes: int
    prefix_cache_bytes: int  # the sampler's prefix KV cache (its pool of prompt blocks, and their state snapshots)
    work_bytes: int  # capacity - resident - snapshots - prefix cache - reserve: what one op may use at a time
    train_bytes_per_token: int  # a forward_backward token, with gradient checkpointing (Remat.FULL)
    train_bytes_per_token_no_remat: int
    train_bytes_per_token_dots: int  # with the matmul outputs saved (Remat.DOTS)
    train_fixed_bytes: int  # the chunked logits and their gradient (at most: shorter sequences hold less)
    kv_bytes_per_token: int  # one token of KV cache (every layer's keys and values)
    prefill_bytes_per_token: int  # a prompt token's activations while it is prefilled (besides its KV)
    max_train_tokens: int  # per forward_backward datum (and micro-batch)
    remat_min_tokens: int  # micro-batches of at least this many tokens recompute (at least DOTS) in the backward pass
    full_remat_min_tokens: int  # ... and of at least this many recompute whole layers (FULL)
    max_sample_tokens: int  # prompt + max_tokens of one sampled row (one slot's KV cache and its prefill)
    max_lora_rank: int
    # One decode slot's recurrent state (linear-attention layers), whatever its length; 0 for keys and values only.
    state_bytes_per_slot: int = 0

    def as_metrics(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if isinstance(v, int)}

    def remat_for(self, tokens: int) -> Remat:
        """The level a micro-batch of `tokens` tokens trains at (training/steps.py asks by these thresholds)."""
        if tokens >= self.full_remat_min_tokens:
            return Remat.FULL
        return Remat.DOTS if tokens >= self.remat_min_tokens else Remat.NONE

    def train_bytes_at(self, level: Remat) -> int:
        """Bytes per training token at `level`."""
        return {
            Remat.NONE: self.train_bytes_per_token_no_remat,
            Remat.DOTS: self.train_bytes_per_token_dots,
            Remat.FULL: self.train_bytes_per_token,
        }[level]

    def free_bytes(self) -> int:
        """Memory free for work now: the capacity less what is in use (the allocator's count on accelerators, this
        process's resident set on CPU) and the reserve."""
        _, _, in_use = device_capacity()
        free = self.capacity_bytes - in_use
        if self.device.startswith("host memory"):  # other processes share the host: what the kernel has left
            free = min(free, _host_available_bytes())
        return max(0, free - self.reserve_bytes)

    def kv_slots(self, cache_len: int) -> int:
        """Decode slots whose KV caches of `cache_len` (and recurrent states) fit the work memory."""
        per_slot = cache_len * (self.kv_bytes_per_token + SLOT_BUFFER_BYTES_PER_TOKEN) + self.state_bytes_per_slot
        return max(0, int(self.work_bytes * TRAIN_SHARE) // max(1, per_slot))

    def kv_tokens(self, slots: int) -> int:
        """KV-cache positions (with their slot buffers) that fit the work memory beside `slots` slots' states."""
        room = int(self.work_bytes * TRAIN_SHARE) - slots * self.state_bytes_per_slot
        return max(0, room // (self.kv_bytes_per_token + SLOT_BUFFER_BYTES_PER_TOKEN))

    def prefill_rows(self, prompt_len: int, slots: int, cache_len: int) -> int:
        """Prompt rows one admission may prefill at once beside `slots` KV caches of `cache_len` (at least 1)."""
        room = int(self.work_bytes * TRAIN_SHARE) - slots * (
            cache_len * self.kv_bytes_per_token + self.state_bytes_per_slot
        )
        per_row = prompt_len * (self.prefill_bytes_per_token + self.kv_bytes_per_token)
        return max(1, room // max(1, per_row))

    def train_limit_message(self, what: str, tokens: int) -> str:
        return (
            f"{what} has {tokens:,} tokens; this worker fits {self.max_train_tokens:,} tokens per forward_backward "
            f"datum at LoRA rank {self.max_lora_rank} ({self.work_bytes / GIB:.1f} GiB of {self.device} for work after "
            f"weights, adapter slots and snapshots). Split the sequence, or give the worker more memory: {FLAGS}"
        )

    def sample_limit_message(self, tokens: int) -> str:
        return (
            f"prompt + max_tokens is {tokens:,} tokens; this worker fits {self.max_sample_tokens:,} tokens of KV cache "
            f"per sampled sequence ({self.work_bytes / GIB:.1f} GiB of {self.device} for work). Shorten the prompt or "
            f"max_tokens, or give the worker more memory: {FLAGS}"
        )


def device_capacity(override_bytes: int = 0) -> tuple[str, int, int]:
    """(what it is, capacity bytes, bytes in use now) of the first local device; host RAM on CPU. A positive
    `override_bytes` caps the capacity (the --device-memory-gb flag)."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        name, capacity, in_use = f"{dev.device_kind} memory", int(stats["bytes_limit"]), int(stats["bytes_in_use"])
    else:
        name, capacity, in_use = "host memory", _host_memory_bytes(), _rss_bytes()
    if override_bytes > 0:
        name, capacity = f"{name} (capped by --device-memory-gb)", min(capacity, override_bytes)
    return name, capacity, in_use


@functools.cache
def _host_memory_bytes() -> int:
    """The container's memory limit (cgroup v2/v1) when it has one, else the machine's MemTotal. Read once: it is
    asked before every micro-batch, and reading the cgroup files cost more CPU than a small step's host work."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()  # noqa: SIM115 (a one-line read)
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GIB


def _host_available_bytes() -> int:
    """MemAvailable: what the host can still give without swapping (other processes included)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def per_token_costs(config: ModelConfig, dtype: Any, max_rank: int) -> dict[str, int]:
    """Bytes per token of training (at each gradient-checkpointing level), of KV cache, and of prefill."""
    f32, cd = 4, int(np.dtype(dtype).itemsize)
    h, layers = config.hidden_size, config.num_layers
    kv = config.num_kv_heads * config.head_dim
    family = family_named(config.arch)
    # One layer's intermediates, forward (the family's widest layer: model/layer_costs.py); the backward holds part
    # as much again in gradients (XLA reuses buffers).
    layer = family.activation_bytes(config, cd, max_rank)
    layer_fwd_bwd = int(1.2 * layer)
    remat = layers * h * f32 + layer_fwd_bwd + 4 * h * f32  # saved layer inputs + one layer live + embed/norm
    # DOTS: per layer its float32 input and its saved matmul outputs (layer_costs.saved_matmul_bytes: the projections
    # as they accumulate, float32; the attention's output and log-sum-exp; each x @ A), never more than the whole
    # layer's forward keeps (a family whose layers are not the dense ones: the bound holds it), + one layer live:
    #   L * (4 H + min(saved, layer)) + 1.2 layer + 16 H
    dots = layers * (h * f32 + min(saved_matmul_bytes(config, max_rank), layer)) + layer_fwd_bwd + 4 * h * f32
    no_remat = layers * layer + layer_fwd_bwd + 4 * h * f32
    kv_token = family.cache_kinds(config).count("kv") * 2 * kv * cd
    prefill = layer + 2 * h * f32  # one layer at a time, no backward (the KV is counted apart)
    return {"train": remat, "train_dots": dots, "train_no_remat": no_remat, "kv": kv_token, "prefill": prefill}


def make_plan(
    config: ModelConfig,
    dtype: Any,
    *,
    max_lora_rank: int,
    snapshot_bytes: int,
    override_bytes: int = 0,
    max_position: int | None = None,
    prefix_cache_tokens: int = 0,
    host_pages_bytes: int = 0,
) -> MemoryPlan:
    device, capacity, resident = device_capacity(override_bytes)
    reserve = max(RESERVE_MIN, int(capacity * RESERVE_SHARE))
    # Paged-out adapters and snapshots live in host memory (runtime/paging_store.py): where the device is the host,
    # their budget is memory work cannot have.
    paged = host_pages_bytes if device.startswith("host memory") else 0
    costs = per_token_costs(config, dtype, max_lora_rank)
    # The pool's blocks of keys and values, and a recurrent model's state snapshots beside them (prefix_cache.py).
    prefix = prefix_cache_tokens * costs["kv"]
    if state_bytes_per_slot(config):
        prefix += state_slots(max(1, prefix_cache_tokens // BLOCK)) * state_bytes_per_slot(config)
    work = max(0, capacity - resident - snapshot_bytes - reserve - prefix - paged)
    # A chunk of positions' logits, their log-softmax and their gradient (model/logprobs.py): per token up to the
    # chunk's length (a small vocabulary's whole sequence is one chunk), a fixed cost past it.
    chunk = chunk_tokens(1, config.vocab_size)
    logits_token = 3 * config.vocab_size * 4
    train_fixed = chunk * logits_token
    room = int(work * TRAIN_SHARE)
    if room >= chunk * (costs["train"] + logits_token):
        max_train = chunk + (room - train_fixed - chunk * costs["train"]) // costs["train"]
    else:
        max_train = room // (costs["train"] + logits_token)
    max_sample = int(work * TRAIN_SHARE) // (costs["kv"] + costs["prefill"] + SLOT_BUFFER_BYTES_PER_TOKEN)
    # Rows are padded to length buckets: the limits are bucket lengths, so whatever fits them fits padded.
    max_train, max_sample = round_down_seq_len(max_train), round_down_seq_len(max_sample, minimum=128)
    if max_position:
        max_train, max_sample = min(max_train, max_position), min(max_sample, max_position)
    plan = MemoryPlan(
        device=device,
        capacity_bytes=capacity,
        resident_bytes=resident,
        snapshot_bytes=snapshot_bytes,
        reserve_bytes=reserve,
        prefix_cache_bytes=prefix,
        work_bytes=work,
        train_bytes_per_token=costs["train"],
        train_bytes_per_token_no_remat=costs["train_no_remat"],
        train_bytes_per_token_dots=costs["train_dots"],
        train_fixed_bytes=train_fixed,
        kv_bytes_per_token=costs["kv"],
        prefill_bytes_per_token=costs["prefill"],
        max_train_tokens=int(max_train),
        remat_min_tokens=max(1, int(work * NO_REMAT_SHARE) // costs["train_no_remat"]),
        full_remat_min_tokens=max(1, int(work * NO_REMAT_SHARE) // costs["train_dots"]),
        max_sample_tokens=int(max_sample),
        max_lora_rank=max_lora_rank,
        state_bytes_per_slot=state_bytes_per_slot(config),
    )
    log.info(
        "memory plan: %s %.1f GiB = resident %.1f (weights, adapter slots) + snapshots %.1f + prefix cache %.2f"
        " + reserve %.1f + work %.1f;"
        " per token: training %s B (%s B without checkpointing), KV %s B; fits %s tokens per forward_backward datum,"
        " %s tokens per sampled sequence; gradient checkpointing from %s tokens per micro-batch (matmul outputs"
        " kept), whole layers from %s",
        device,
        capacity / GIB,
        resident / GIB,
        snapshot_bytes / GIB,
        prefix / GIB,
        reserve / GIB,
        work / GIB,
        f"{plan.train_bytes_per_token:,}",
        f"{plan.train_bytes_per_token_no_remat:,}",
        f"{plan.kv_bytes_per_token:,}",
        f"{plan.max_train_tokens:,}",
        f"{plan.max_sample_tokens:,}",
        f"{plan.remat_min_tokens:,}",
        f"{plan.full_remat_min_tokens:,}",
    )
    return plan
