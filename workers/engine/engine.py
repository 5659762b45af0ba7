"""The engine: one base model, `max_lora_adapters` trainable LoRA slots, immutable sampler snapshots.

Called from one thread at a time (the JAX worker runs one activity at a time). Every batched call validates each
request on its own; a bad request yields an InputError in its place and never touches adapter state.

`Engine` is a facade over its parts, each in a module named for what it holds: the slots' weights, gradients and
optimizer state (`training/adapter_slots.py`), training on them (`training/trainer.py`), sampler snapshots and their
LoRA stack (`sampling/snapshots.py`), and sampling requests (`sampling/sample_requests.py`, over the sampler in
`sampling/sampler.py`/`sampling/decode.py`). Its public methods are what the activities call
(`interface.EngineApi`), plus reads for export and tests, and the parts the warm-up compiles for.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from . import warm_up
from .model.dtypes import base_dtype, weight_dtype
from .model.families import ModelConfig
from .model.loader import eos_token_ids, load_model, random_model, resolve_model_path
from .model.sharding import DeviceLayout, Mesh, MeshConfig, as_mesh
from .runtime.memory_plan import MemoryPlan, device_capacity, make_plan
from .runtime.paging_store import PageStore, default_host_budget_bytes
from .sampling import sample_requests
from .sampling.buckets import stack_size
from .sampling.prefix_cache import BLOCK
from .sampling.sampler import SlotSampler
from .sampling.snapshots import SamplerSnapshots, Snapshot
from .training import trainer
from .training.adapter_paging import AdapterPager
from .training.adapter_slots import AdapterSlots
from .training.steps import StepFunctions
from .types import (
    AdamConfig,
    DimuonConfig,
    ForwardBackwardInput,
    ForwardBackwardResult,
    InputError,
    LoraConfig,
    ModelInfo,
    PageMoves,
    PageReport,
    SampleInput,
    SampleResult,
    SlotState,
    WarmUpPiece,
    WarmUpPlan,
)

log = logging.getLogger(__name__)

# Tokens per micro-batch (rows x padded length); gradients are sums, so this only bounds activation memory.
DEFAULT_MICRO_BATCH_TOKENS = 16384
# Prompt tokens of keys and values the sampler's prefix cache holds (sampling/prefix_cache.py); 0: no cache.
DEFAULT_PREFIX_CACHE_TOKENS = 65536

__all__ = ["DEFAULT_MICRO_BATCH_TOKENS", "Engine", "MemoryPlan", "Snapshot"]


class Engine:
    def __init__(
        self,
        model_path: str,
        loaded: Any,
        tokenizer: Any,
        info: ModelInfo,
        *,
        max_lora_adapters: int,
        max_lora_rank: int,
        micro_batch_tokens: int,
        snapshot_budget_bytes: int = 0,
        gradient_checkpointing: bool = False,
        device_memory_bytes: int = 0,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        page_store: PageStore | None = None,
    ):
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.info = info
        self.config: ModelConfig = loaded.config
        self.max_lora_adapters = max_lora_adapters
        self.max_lora_rank = max_lora_rank
        self.micro_batch_tokens = micro_batch_tokens
        self._graphdef = loaded.graphdef
        self._layout: DeviceLayout = loaded.placement or DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), loaded.config)
        self.mesh = self._layout.mesh
        self._base = loaded.base
        self.dtype = base_dtype(self._base)
        self._adapters = AdapterSlots(loaded.lora, self._layout, max_adapters=max_lora_adapters, max_rank=max_lora_rank)
        # Sampler snapshots under a byte budget, least recently used out first (snapshots.py); 0: a tenth of the
        # memory the plan divides (the device's, or --device-memory-gb).
        _, capacity, _ = device_capacity(device_memory_bytes)
        self._sampler_snapshots = SamplerSnapshots(self._adapters, snapshot_budget_bytes or int(capacity * 0.10))
        # Adapters and snapshots off the device (runtime/paging_store.py): by default in host memory only.
        self.pages = page_store or PageStore(default_host_budget_bytes(device_memory_bytes))
        self._pager = AdapterPager(self._adapters, self.pages)
        # The most one paged-out adapter takes (weights, gradients, moments, step); how many the store holds.
        self.adapter_page_bytes, self.page_capacity = self._pager.page_bytes, self._pager.capacity
        self._sampler_snapshots.attach_pages(self.pages)
        self._steps = StepFunctions(self._graphdef, self._layout, gradient_checkpointing=gradient_checkpointing)
        self._sampler = SlotSampler(self._graphdef, self._layout, self.config, self.dtype, tokenizer)
        self._sampler.prefix_tokens = max(0, prefix_cache_tokens) // BLOCK * BLOCK
        # What the device holds and how much work fits beside it (runtime/memory_plan.py): made now that the weights
        # and the slots are resident; it admits work and sizes micro-batches, decode slots and prefill rows.
        self._memory = make_plan(
            self.config,
            self.dtype,
            max_lora_rank=max_lora_rank,
            snapshot_bytes=self._sampler_snapshots.cache.budget_bytes,
            override_bytes=device_memory_bytes,
            max_position=info.max_position_embeddings,
            prefix_cache_tokens=self._sampler.prefix_tokens,
            host_pages_bytes=self.pages.host_budget,
        )
        if not gradient_checkpointing:
            self._steps.remat_min_tokens = self._memory.remat_min_tokens
        self.memory = self._memory

    @property
    def memory(self) -> MemoryPlan:
        """The device-memory plan this engine admits work against (runtime/memory_plan.py)."""
        return self._memory

    @memory.setter
    def memory(self, plan: MemoryPlan) -> None:
        self._memory = plan
        self._sampler.memory = plan
        self._steps.max_seq = plan.max_train_tokens

    @property
    def adapters(self) -> AdapterSlots:
        return self._adapters

    @property
    def base(self) -> Any:
        return self._base

    @property
    def steps(self) -> StepFunctions:
        return self._steps

    @property
    def sampler(self) -> SlotSampler:
        return self._sampler

    @property
    def sampler_snapshots(self) -> SamplerSnapshots:
        return self._sampler_snapshots

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        model_path: str,
        *,
        max_lora_adapters: int = 8,
        max_lora_rank: int = 32,
        progress: bool = True,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
        mesh: Mesh | MeshConfig | None = None,
        gradient_checkpointing: bool = False,
        dtype: Any = None,
        snapshot_budget_bytes: int = 0,
        scan_layers: bool = True,
        device_memory_bytes: int = 0,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        page_store: PageStore | None = None,
    ) -> Engine:
        """Load a checkpoint onto `mesh` (a Mesh with axes ("fsdp", "tp"), a MeshConfig, or None for every local
        device on fsdp). Base weights are stored in `dtype` (default: float32 on CPU, bfloat16 on accelerators;
        LoRA parameters, optimizer moments and logits are always float32). `gradient_checkpointing` recomputes each
        decoder layer in the backward pass instead of keeping its activations, for every micro-batch (without it, for
        micro-batches long enough to need it: the memory plan says from how many tokens). `device_memory_bytes` > 0
        caps the memory the plan divides (host RAM on CPU, the allocator's limit on accelerators). `scan_layers`
        (dense models): the layers stacked and run as one scan, so compile time does not grow with depth
        (model/decoder.py); off: a per-layer loop, kept for comparison."""
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        path = resolve_model_path(model_path)
        loaded = load_model(
            path,
            max_adapters=max_lora_adapters,
            max_rank=max_lora_rank,
            progress=progress,
            dtype=weight_dtype(dtype),
            mesh=as_mesh(mesh),
            remat=gradient_checkpointing,
            scan_layers=scan_layers,
        )
        tokenizer = AutoTokenizer.from_pretrained(path)
        cfg = loaded.config
        info = ModelInfo(
            arch=cfg.arch,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            eos_token_ids=eos_token_ids(path, loaded.hf_config, tokenizer),
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
        )
        mesh_shape = dict(loaded.placement.mesh.shape) if loaded.placement is not None else {}
        log.info(
            "loaded %s (%s, %d layers, vocab %d, %s weights, mesh %s%s) with %d LoRA slots of rank <= %d in %.1fs",
            path,
            cfg.arch,
            cfg.num_layers,
            cfg.vocab_size,
            base_dtype(loaded.base),
            mesh_shape,
            ", gradient checkpointing" if gradient_checkpointing else "",
            max_lora_adapters,
            max_lora_rank,
            time.perf_counter() - t0,
        )
        return cls(
            path,
            loaded,
            tokenizer,
            info,
            max_lora_adapters=max_lora_adapters,
            max_lora_rank=max_lora_rank,
            micro_batch_tokens=micro_batch_tokens,
            snapshot_budget_bytes=snapshot_budget_bytes,
            gradient_checkpointing=gradient_checkpointing,
            device_memory_bytes=device_memory_bytes,
            prefix_cache_tokens=prefix_cache_tokens,
            page_store=page_store,
        )

    @classmethod
    def random(
        cls,
        hf_config: dict[str, Any],
        *,
        max_lora_adapters: int = 8,
        max_lora_rank: int = 32,
        seed: int = 0,
        mesh: Mesh | MeshConfig | None = None,
        dtype: Any = None,
        eos_token_ids: tuple[int, ...] = (0,),
        **options: Any,
    ) -> Engine:
        """An engine over random weights of `hf_config`'s shape drawn on the device (loader.random_model), no
        checkpoint and no tokenizer (stop strings then cannot be checked): for benchmarks and device checks.
        `options`: as for `load` (micro_batch_tokens, gradient_checkpointing, device_memory_bytes, ...)."""
        loaded = random_model(
            hf_config,
            max_adapters=max_lora_adapters,
            max_rank=max_lora_rank,
            seed=seed,
            dtype=weight_dtype(dtype),
            mesh=as_mesh(mesh),
        )
        cfg = loaded.config
        info = ModelInfo(
            arch=cfg.arch,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos_token_ids,
            max_position_embeddings=cfg.max_position_embeddings,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
        )
        options.setdefault("micro_batch_tokens", DEFAULT_MICRO_BATCH_TOKENS)
        return cls(
            "random", loaded, None, info, max_lora_adapters=max_lora_adapters, max_lora_rank=max_lora_rank, **options
        )

    # ------------------------------------------------------------------ adapters

    def create_adapter(self, slot: int, config: LoraConfig) -> None:
        self._adapters.create(slot, config)

    def free_adapter(self, slot: int) -> None:
        self._adapters.free(slot)

    def adapter_weights(self, slot: int) -> dict[str, np.ndarray]:
        """The slot's LoRA A [in, rank] / B [rank, out] by module path (e.g. "layers.0.mlp.up_proj.lora_a"),
        trimmed to its rank; for export and tests."""
        return self._adapters.named(self._adapters.lora, slot)

    def accumulated_grads(self, slot: int) -> dict[str, np.ndarray]:
        """Gradients accumulated for the slot since its last optim_step, named and trimmed like adapter_weights."""
        return self._adapters.named(self._adapters.grads, slot)

    def set_adapter_weights(self, slot: int, weights: dict[str, np.ndarray]) -> None:
        """Overwrite an allocated slot's LoRA weights (names and rank-trimmed shapes as in adapter_weights)."""
        self._adapters.set_weights(slot, weights)

    def export_slot(self, slot: int) -> SlotState:
        """The slot's config, weights, optimizer moments and step, named and trimmed like adapter_weights."""
        return self._adapters.export(slot)

    def import_slot(self, slot: int, state: SlotState, *, optimizer: bool) -> LoraConfig:
        """(Re)configure `slot` (allocated or not) as `state`: its weights, and its optimizer moments and step when
        `optimizer` (else zero moments, step 0); the gradient accumulator is zeroed. Missing tensors are zero. An
        allocated slot keeps its optimizer family (with `optimizer`, the state's must be the same). Every check runs
        before anything is written. Returns the slot's config as it now is."""
        return self._adapters.import_(slot, state, optimizer=optimizer)

    # ------------------------------------------------------------------ paging (more runs than slots)

    def page(self, moves: PageMoves) -> PageReport:
        """Move adapters between training slots and the page store (training/adapter_paging.py); a move that fails
        leaves that adapter lost on this worker (its slot free), named in the report, and the others go on."""
        return self._pager.move(moves)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, slot: int, key: str) -> None:
        """An immutable sampler snapshot of the slot's weights as they are now."""
        self._sampler_snapshots.take(slot, key)

    def load_snapshot(self, key: str, config: LoraConfig, weights: dict[str, np.ndarray]) -> None:
        """A sampler snapshot from named weights (as adapter_weights; missing ones are zero), no slot involved."""
        self._sampler_snapshots.load(key, config, weights)

    def snapshot_evicted(self, key: str) -> bool:
        """True when `key` was a snapshot here and the byte budget pushed it out (saved weights reload on demand)."""
        return self._sampler_snapshots.evicted(key)

    def drop_snapshot(self, key: str) -> None:
        self._sampler_snapshots.drop(key)

    # ------------------------------------------------------------------ training

    def forward_backward(self, requests: list[ForwardBackwardInput]) -> list[ForwardBackwardResult | InputError]:
        budget = max(16, min(self.micro_batch_tokens, self.memory.max_train_tokens))
        return trainer.forward_backward(
            self._adapters,
            self._steps,
            self._base,
            requests,
            info=self.info,
            micro_batch_tokens=budget,
            memory=self.memory,
            room=self._room,
        )

    def _room(self, needed: int) -> int:
        """Bytes free for a program that needs `needed`, after letting go of the sampler's idle KV caches if that is
        what it takes."""
        free = self.memory.free_bytes()
        if needed > free and self._sampler.release_idle():
            free = self.memory.free_bytes()
        return free

    def optim_step(self, slot: int, config: AdamConfig | DimuonConfig) -> dict[str, float]:
        return trainer.optim_step(self._adapters, slot, config)

    # ------------------------------------------------------------------ sampling

    @property
    def sample_slots(self) -> int:
        """Decode slots (rows decoded together) at most; smaller row buckets are powers of 8 below it."""
        return self._sampler.max_slots

    @sample_slots.setter
    def sample_slots(self, value: int) -> None:
        self._sampler.max_slots = self._layout.round_rows(int(value))

    @property
    def slot_buckets(self) -> list[int]:
        """The sampler's decode-slot buckets (rows decoded together), smallest first."""
        return [b.slots for b in self._sampler.buckets()]

    def prefer_buckets(self, plan: WarmUpPlan) -> None:
        """Round training sequences up to the buckets `plan` warms, where one fits, so a workload within them
        compiles nothing (from now on, whether or not the warm-up ran yet). The sampler's shapes are fixed already
        (sampling/buckets.py)."""
        pieces = plan.pieces()
        self._steps.warmed_seqs = frozenset(p.seq for p in pieces if p.kind == "train")
        self._steps.warmed_rows = frozenset(p.rows for p in pieces if p.kind == "train")

    def schedule_warm_up(self, pieces: tuple[WarmUpPiece, ...]) -> None:
        """The sampler families among `pieces` are about to be warmed up in the background: a request that comes
        first compiles only its own slot bucket of them (sampler.py)."""
        self._sampler.scheduled_families = frozenset(
            (stack_size(p.adapters), p.scoring) for p in pieces if p.kind == "sampler"
        )

    def warm_up(self, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
        """Compile ahead of traffic what `pieces` name (see warm_up.py; `WarmUpPlan.pieces()` lists them), leaving
        no state behind; returns the number of programs built (compiled, or read back from the persistent cache).
        `threads` > 1: the train buckets' steps compile side by side on that many threads."""
        return warm_up.run(self, tuple(pieces), threads)

    def compile_ahead(self, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
        """Compile, never run, the train buckets and sampler families among `pieces` (COMPILE_ONLY_KINDS), from the
        state's shapes alone: safe beside any other call of this engine, from another thread
        (warm_up.compile_ahead). Programs built."""
        return warm_up.compile_ahead(self, tuple(pieces), threads)

    def sample(self, requests: list[SampleInput]) -> list[SampleResult | InputError]:
        with self._sampler_snapshots.paged_in(r.snapshot for r in requests if r.snapshot is not None):
            return sample_requests.sample(
                self._sampler, self._sampler_snapshots, self._base, requests, info=self.info, memory=self.memory
            )
