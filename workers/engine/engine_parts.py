"""The engine's parts and how they come to be: a checkpoint (or random weights of a checkpoint's shape) loaded onto the
device mesh, the adapter slots and their page store, the training steps, the sampler and its snapshots, and the
device-memory plan that sizes them all (`EngineParts`, which `engine.Engine` extends with the calls)."""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Self

from .model.decoder_stack import resolve_decode_layers
from .model.dtypes import base_dtype, weight_dtype
from .model.families import ModelConfig, family_named
from .model.image_inputs import image_token_id
from .model.loader import eos_token_ids, load_model, random_model, resolve_model_path
from .model.sharding import DeviceLayout, Mesh, MeshConfig, as_mesh
from .runtime.memory_plan import MemoryPlan, device_capacity, make_plan
from .runtime.paging_store import PageStore, default_host_budget_bytes
from .sampling.prefix_cache import BLOCK
from .sampling.sampler import SlotSampler
from .sampling.snapshots import SamplerSnapshots
from .training.adapter_paging import AdapterPager
from .training.adapter_slots import AdapterSlots
from .training.steps import StepFunctions
from .types import ModelInfo

log = logging.getLogger(__name__)

# Tokens per micro-batch (rows x padded length); gradients are sums, so this only bounds activation memory.
DEFAULT_MICRO_BATCH_TOKENS = 16384
# Prompt tokens of keys and values the sampler's prefix cache holds (sampling/prefix_cache.py); 0: no cache.
DEFAULT_PREFIX_CACHE_TOKENS = 65536


def directory_tokenizer(path: str, *, required: bool):
    """The model directory's tokenizer; None where it has none and none is `required` (a config-only directory
    served with random weights: token ids still work, stop strings and chat templates do not)."""
    from transformers import AutoTokenizer

    if not required and not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        log.warning("%s has no tokenizer: clients must send token ids (stop strings cannot be checked)", path)
        return None
    return AutoTokenizer.from_pretrained(path)


class EngineParts:
    """The engine's parts, built and wired together: the base weights and their device layout, the adapter slots,
    the page store and pager, the training steps, the sampler and its snapshots, and the memory plan they share;
    made from a checkpoint (`load`) or random weights (`random`). `Engine` adds the calls that run on them."""

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
        decode_layers: str = "auto",
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
        image_batch = family_named(self.config.arch).image_batch
        if info.image_token_id is not None and image_batch is not None:  # the model holds a vision tower
            self._steps.image_batch = functools.partial(image_batch, self.config)
        self._sampler = SlotSampler(self._graphdef, self._layout, self.config, self.dtype, tokenizer)
        self._sampler.prefix_tokens = max(0, prefix_cache_tokens) // BLOCK * BLOCK
        self._sampler.programs.decode_layers = resolve_decode_layers(decode_layers)
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
        if not gradient_checkpointing:  # the plan's levels by length (with it: always Remat.FULL)
            self._steps.remat_min_tokens = self._memory.remat_min_tokens
            self._steps.full_remat_min_tokens = self._memory.full_remat_min_tokens
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
    def decode_layers(self) -> str:
        """How the sampler's programs run a stacked model's layers: "scan" or "unrolled" ("auto" resolved)."""
        return self._sampler.programs.decode_layers

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
        compute_dtype_residual: bool = False,
        device_memory_bytes: int = 0,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        decode_layers: str = "auto",
        page_store: PageStore | None = None,
        random_weights: bool = False,
    ) -> Self:
        """Load a checkpoint onto `mesh` (a Mesh with axes ("fsdp", "tp"), a MeshConfig, or None for every local
        device on fsdp). Base weights are stored in `dtype` (default: float32 on CPU, bfloat16 on accelerators;
        LoRA parameters, optimizer moments and logits are always float32). `gradient_checkpointing` recomputes each
        decoder layer in the backward pass instead of keeping its activations, for every micro-batch (Remat.FULL;
        without it the memory plan picks per micro-batch length: none, DOTS or FULL, model/remat.py).
        `device_memory_bytes` > 0 caps the memory the plan divides (host RAM on CPU, the allocator's limit on
        accelerators). `scan_layers` (dense models): the layers stacked and run as one scan, so compile time does not
        grow with depth (model/decoder.py); off: a per-layer loop, kept for comparison. `decode_layers` ("scan",
        "unrolled" or "auto": unrolled on accelerators, scan on CPU): how the sampler's programs, which run with a
        KV cache, run those stacked layers (model/decoder_stack.py); training always scans.
        `compute_dtype_residual`: the residual stream between layers in the compute dtype (decoder.CausalLM; off by
        default: it changes bf16 numerics; the memory plan still counts it at float32, an overestimate).
        `random_weights`: the directory's config.json alone, its weights drawn on the device (loader.random_model)
        and its tokenizer read where it has one: a real model's shape served without its checkpoint, for benchmarks
        of the whole service."""
        t0 = time.perf_counter()
        path = resolve_model_path(model_path)
        build = dict(
            dtype=weight_dtype(dtype),
            mesh=as_mesh(mesh),
            remat=gradient_checkpointing,
            scan_layers=scan_layers,
            compute_dtype_residual=compute_dtype_residual,
        )
        if random_weights:
            hf_config = json.loads((Path(path) / "config.json").read_text())
            loaded = random_model(hf_config, max_adapters=max_lora_adapters, max_rank=max_lora_rank, **build)
        else:
            loaded = load_model(
                path, max_adapters=max_lora_adapters, max_rank=max_lora_rank, progress=progress, **build
            )
        tokenizer = directory_tokenizer(path, required=not random_weights)
        cfg = loaded.config
        info = ModelInfo(
            arch=cfg.arch,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            eos_token_ids=eos_token_ids(path, loaded.hf_config, tokenizer),
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            image_token_id=image_token_id(cfg),
        )
        mesh_shape = dict(loaded.placement.mesh.shape) if loaded.placement is not None else {}
        log.info(
            "loaded %s (%s, %d layers, vocab %d, %s weights%s, mesh %s%s) with %d LoRA slots of rank <= %d in %.1fs",
            path,
            cfg.arch,
            cfg.num_layers,
            cfg.vocab_size,
            base_dtype(loaded.base),
            " drawn at random" if random_weights else "",
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
            decode_layers=decode_layers,
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
    ) -> Self:
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
            compute_dtype_residual=options.pop("compute_dtype_residual", False),
        )
        cfg = loaded.config
        info = ModelInfo(
            arch=cfg.arch,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos_token_ids,
            max_position_embeddings=cfg.max_position_embeddings,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            image_token_id=image_token_id(cfg),
        )
        options.setdefault("micro_batch_tokens", DEFAULT_MICRO_BATCH_TOKENS)
        return cls(
            "random", loaded, None, info, max_lora_adapters=max_lora_adapters, max_lora_rank=max_lora_rank, **options
        )
