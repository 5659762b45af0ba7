"""The engine: one base model, `max_lora_adapters` trainable LoRA slots, immutable sampler snapshots.

Called from one thread at a time (the JAX worker runs one activity at a time). Every batched call validates each
request on its own; a bad request yields an InputError in its place and never touches adapter state.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig, round_up_pow2
from .loader import eos_token_ids, load_model, resolve_model_path
from .lora import LORA_ALPHA, init_a, is_a_leaf, module_kind
from .optimizer import OptState, adamw_slot_values, pack_hparams, write_slot_values
from .sampler import MIN_STOP_IDS, SampleRow, SlotSampler, seed_words
from .sharding import Mesh, MeshConfig, Placement, as_mesh
from .snapshots import SnapshotCache, default_budget_bytes, evicted_message
from .train import Row, StepFunctions, run_rows
from .types import (
    AdamConfig,
    ForwardBackwardInput,
    ForwardBackwardResult,
    InputError,
    LoraConfig,
    ModelInfo,
    SampledSequence,
    SampleInput,
    SampleResult,
    SlotState,
    TOPK_PAD_LOGPROB,
)
from .validation import check_sample, forward_backward_rows

log = logging.getLogger(__name__)

# Tokens per micro-batch (rows x padded length); gradients are sums, so this only bounds activation memory.
DEFAULT_MICRO_BATCH_TOKENS = 16384


@dataclass(frozen=True)
class Snapshot:
    lora: Any  # LoRA state without the adapter axis
    scale: float


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
    ):
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.info = info
        self.config: ModelConfig = loaded.config
        self.max_lora_adapters = max_lora_adapters
        self.max_lora_rank = max_lora_rank
        self.micro_batch_tokens = micro_batch_tokens
        self._graphdef = loaded.graphdef
        self._placement: Placement = loaded.placement or Placement(as_mesh(MeshConfig(fsdp=1, tp=1)), loaded.config)
        self.mesh = self._placement.mesh
        self._base = loaded.base
        self._lora = self._put_lora(loaded.lora)
        self.dtype = _base_dtype(self._base)
        self._grads = self._put_lora(jax.tree.map(jnp.zeros_like, self._lora))
        self._opt = self._put_opt(OptState.zeros_like(self._lora))
        self._slots: dict[int, LoraConfig] = {}
        # Sampler snapshots under a byte budget, least recently used out first (snapshots.py); 0: a tenth of the
        # device's memory.
        self._snapshots = SnapshotCache(snapshot_budget_bytes or default_budget_bytes())
        self._steps = StepFunctions(self._graphdef, self._placement)
        self._sampler = SlotSampler(self._graphdef, self._placement, self.config, self.dtype, tokenizer)
        placement = self._placement

        # Slot writes as one jitted update of the whole tree (one compile, in place), keeping every sharding.
        def write_slot(tree, slot, values):
            return placement.constrain_params(jax.tree.map(lambda x, v: x.at[slot].set(v.astype(x.dtype)), tree, values))

        def zero_slot(tree, slot):
            # Any pytree whose leaves carry the adapter axis first (LoRA-shaped trees, OptState with its counts).
            out = jax.tree.map(lambda x: x.at[slot].set(jnp.zeros((), x.dtype)), tree)
            if isinstance(out, OptState):
                return OptState(mu=placement.constrain_params(out.mu), nu=placement.constrain_params(out.nu),
                                count=jax.lax.with_sharding_constraint(out.count, placement.replicated))  # fmt: skip
            return placement.constrain_params(out)

        self._write_slot = jax.jit(write_slot, donate_argnums=0)
        self._take_slot = jax.jit(lambda tree, slot: jax.tree.map(lambda x: x[slot], tree))

        def stack(snaps, like, size):
            def one(slot_leaf, *leaves):
                zero = jnp.zeros(slot_leaf.shape[1:], slot_leaf.dtype)
                return jnp.stack([*leaves] + [zero] * (size - len(leaves)))

            return placement.constrain_params(jax.tree.map(one, like, *snaps))

        self._stack = jax.jit(stack, static_argnums=2)
        self._zero_slot = jax.jit(zero_slot, donate_argnums=0)
        self._stack_cache: tuple[tuple, Any] | None = None

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
    ) -> Engine:
        """Load a checkpoint onto `mesh` (a Mesh with axes ("fsdp", "tp"), a MeshConfig, or None for every local
        device on fsdp). Base weights are stored in `dtype` (default: float32 on CPU, bfloat16 on accelerators;
        LoRA parameters, optimizer moments and logits are always float32). `gradient_checkpointing` recomputes each
        decoder layer in the backward pass instead of keeping its activations."""
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        path = resolve_model_path(model_path)
        loaded = load_model(
            path, max_adapters=max_lora_adapters, max_rank=max_lora_rank, progress=progress,
            dtype=_weight_dtype(dtype), mesh=as_mesh(mesh),
            remat=gradient_checkpointing,
        )  # fmt: skip
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
        assert loaded.placement is not None  # as_mesh always gives load_model a mesh
        mesh_shape = dict(loaded.placement.mesh.shape)
        log.info(
            "loaded %s (%s, %d layers, vocab %d, %s weights, mesh %s%s) with %d LoRA slots of rank <= %d in %.1fs",
            path, cfg.arch, cfg.num_layers, cfg.vocab_size, _base_dtype(loaded.base), mesh_shape,
            ", gradient checkpointing" if gradient_checkpointing else "", max_lora_adapters, max_lora_rank,
            time.perf_counter() - t0,
        )  # fmt: skip
        return cls(
            path,
            loaded,
            tokenizer,
            info,
            max_lora_adapters=max_lora_adapters,
            max_lora_rank=max_lora_rank,
            micro_batch_tokens=micro_batch_tokens,
            snapshot_budget_bytes=snapshot_budget_bytes,
        )

    # ------------------------------------------------------------------ adapters

    def _check_slot(self, slot: int, *, allocated: bool = True) -> None:
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.max_lora_adapters):
            raise InputError(f"adapter slot {slot} out of range [0, {self.max_lora_adapters})")
        if allocated and slot not in self._slots:
            raise InputError(f"adapter slot {slot} is not allocated")

    def _scale(self, slot: int) -> float:
        return LORA_ALPHA / self._slots[slot].rank

    def _check_rank(self, config: LoraConfig) -> None:
        if not (1 <= config.rank <= self.max_lora_rank):
            raise InputError(f"LoRA rank {config.rank} must be in [1, {self.max_lora_rank}] (max_lora_rank)")

    def create_adapter(self, slot: int, config: LoraConfig) -> None:
        self._check_slot(slot, allocated=False)
        self._check_rank(config)
        rng = np.random.default_rng(config.seed if config.seed is not None else secrets.randbits(63))
        trained = {"attn": config.train_attn, "mlp": config.train_mlp, "unembed": config.train_unembed}

        def init(path, leaf):
            # A random (PEFT's kaiming-uniform) in trained groups, B zero: the fresh adapter equals the base model.
            if is_a_leaf(path) and trained[module_kind(path)]:
                *experts, in_features, max_rank = leaf.shape[1:]  # MoE expert A: [E, in, R], one draw per expert
                if experts:
                    return np.stack([init_a(rng, in_features, config.rank, max_rank) for _ in range(experts[0])])
                return init_a(rng, in_features, config.rank, max_rank)
            return np.zeros(leaf.shape[1:], np.float32)

        values = jax.tree_util.tree_map_with_path(init, self._lora)
        self._lora = self._write_slot(self._lora, np.int32(slot), values)
        self._zero_training_state(slot)
        self._slots[slot] = config

    def free_adapter(self, slot: int) -> None:
        self._check_slot(slot, allocated=False)
        self._lora = self._zero_slot(self._lora, np.int32(slot))
        self._zero_training_state(slot)
        self._slots.pop(slot, None)

    def _zero_training_state(self, slot: int) -> None:
        self._grads = self._zero_slot(self._grads, np.int32(slot))
        self._opt = self._zero_slot(self._opt, np.int32(slot))

    def _put_lora(self, tree: Any) -> Any:
        """LoRA-shaped state (weights, gradients, moments) on its shardings; a no-op when already there."""
        return self._placement.put_params(tree)

    def _put_opt(self, opt: OptState) -> OptState:
        return OptState(
            mu=self._put_lora(opt.mu), nu=self._put_lora(opt.nu), count=self._placement.put_replicated(opt.count)
        )

    def snapshot(self, slot: int, key: str) -> None:
        self._check_slot(slot)
        # Indexing copies, so later training of the slot cannot change the snapshot.
        lora = self._take_slot(self._lora, np.int32(slot))
        self._snapshots[key] = Snapshot(lora=lora, scale=self._scale(slot))
        self._stack_cache = None

    def load_snapshot(self, key: str, config: LoraConfig, weights: dict[str, np.ndarray]) -> None:
        """A sampler snapshot from named weights (as adapter_weights; missing ones are zero), no slot involved."""
        self._check_rank(config)
        full = self._full_slot(config, weights, "weights")
        # Through an adapter axis of one, so the snapshot is placed exactly as snapshot() places one.
        lora = self._take_slot(self._put_lora(jax.tree.map(lambda x: x[None], full)), np.int32(0))
        self._snapshots[key] = Snapshot(lora=lora, scale=LORA_ALPHA / config.rank)
        self._stack_cache = None

    def snapshot_evicted(self, key: str) -> bool:
        """True when `key` was a snapshot here and the byte budget pushed it out (saved weights reload on demand)."""
        return key in self._snapshots.evicted and key not in self._snapshots

    def drop_snapshot(self, key: str) -> None:
        self._snapshots.pop(key, None)
        self._stack_cache = None

    def adapter_weights(self, slot: int) -> dict[str, np.ndarray]:
        """The slot's LoRA A [in, rank] / B [rank, out] by module path (e.g. "layers.0.mlp.up_proj.lora_a"),
        trimmed to its rank; for export and tests."""
        return self._named_slot(self._lora, slot)

    def accumulated_grads(self, slot: int) -> dict[str, np.ndarray]:
        """Gradients accumulated for the slot since its last optim_step, named and trimmed like adapter_weights."""
        return self._named_slot(self._grads, slot)

    def set_adapter_weights(self, slot: int, weights: dict[str, np.ndarray]) -> None:
        """Overwrite an allocated slot's LoRA weights (names and rank-trimmed shapes as in adapter_weights)."""
        self._check_slot(slot)
        rank = self._slots[slot].rank
        current = self._named_slot(self._lora, slot)
        unknown = sorted(set(weights) - set(current))
        if unknown:
            raise InputError(f"unknown LoRA weights {unknown[:3]}")
        for name, value in weights.items():
            if np.shape(value) != current[name].shape:
                raise InputError(f"{name}: shape {np.shape(value)} != {current[name].shape} (rank {rank})")

        current_full = {
            _leaf_name(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(
                self._placement.to_host(self._take_slot(self._lora, np.int32(slot))))[0]
        }

        def put(path, leaf):
            value = weights.get(_leaf_name(path))
            if value is None:
                return current_full[_leaf_name(path)]
            full = np.zeros(leaf.shape[1:], np.float32)
            if is_a_leaf(path):
                full[..., :rank] = value
            else:
                full[..., :rank, :] = value
            return full

        self._lora = self._write_slot(self._lora, np.int32(slot), jax.tree_util.tree_map_with_path(put, self._lora))

    def export_slot(self, slot: int) -> SlotState:
        """The slot's config, weights, AdamW moments and step, named and trimmed like adapter_weights."""
        self._check_slot(slot)
        return SlotState(
            config=self._slots[slot],
            weights=self._named_slot(self._lora, slot),
            mu=self._named_slot(self._opt.mu, slot),
            nu=self._named_slot(self._opt.nu, slot),
            step=int(np.asarray(self._opt.count)[slot]),
        )

    def import_slot(self, slot: int, state: SlotState, *, optimizer: bool) -> None:
        """(Re)configure `slot` (allocated or not) as `state`: its weights, and its AdamW moments and step when
        `optimizer` (else zero moments, step 0); the gradient accumulator is zeroed. Missing tensors are zero. Every
        check runs before anything is written."""
        self._check_slot(slot, allocated=False)
        self._check_rank(state.config)
        weights = self._full_slot(state.config, state.weights, "weights")
        if optimizer:
            if not (isinstance(state.step, (int, np.integer)) and 0 <= state.step < 2**31):
                raise InputError(f"optimizer step {state.step!r} must be an integer in [0, 2**31)")
            mu, nu = self._full_slot(state.config, state.mu, "mu"), self._full_slot(state.config, state.nu, "nu")
        self._lora = self._write_slot(self._lora, np.int32(slot), weights)
        self._zero_training_state(slot)
        if optimizer:
            s = np.int32(slot)
            self._opt = self._put_opt(OptState(
                mu=self._write_slot(self._opt.mu, s, mu), nu=self._write_slot(self._opt.nu, s, nu),
                count=self._opt.count.at[slot].set(int(state.step)),
            ))  # fmt: skip
        self._slots[slot] = state.config

    def _full_slot(self, config: LoraConfig, named: dict[str, np.ndarray], what: str) -> Any:
        """Named rank-trimmed tensors as one slot's full LoRA-shaped tree (numpy, no adapter axis), zero beyond the
        rank and wherever a name is missing; InputError for unknown names, wrong shapes, non-finite values, or
        non-zero values in a module group the config does not train."""
        trained = {"attn": config.train_attn, "mlp": config.train_mlp, "unembed": config.train_unembed}
        rank = config.rank
        paths = jax.tree_util.tree_flatten_with_path(self._lora)[0]
        unknown = sorted(set(named) - {_leaf_name(p) for p, _ in paths})
        if unknown:
            raise InputError(f"unknown LoRA {what} {unknown[:3]}")

        def full(path, leaf):
            name, out = _leaf_name(path), np.zeros(leaf.shape[1:], np.float32)
            if named.get(name) is None:
                return out
            value = np.asarray(named[name])
            expected = (*leaf.shape[1:-1], rank) if is_a_leaf(path) else (*leaf.shape[1:-2], rank, leaf.shape[-1])
            if value.shape != expected:
                raise InputError(f"{what} {name}: shape {value.shape} != {expected} for rank {rank}")
            if not np.all(np.isfinite(value)):
                raise InputError(f"{what} {name}: non-finite values")
            if not trained[module_kind(path)] and np.any(value):
                raise InputError(f"{what} {name}: non-zero, but its {module_kind(path)} group is not trained")
            if is_a_leaf(path):
                out[..., :rank] = value
            else:
                out[..., :rank, :] = value
            return out

        return jax.tree_util.tree_map_with_path(full, self._lora)

    def _named_slot(self, tree: Any, slot: int) -> dict[str, np.ndarray]:
        self._check_slot(slot)
        rank = self._slots[slot].rank
        out = {}
        host = self._placement.to_host(self._take_slot(tree, np.int32(slot)))  # one gather, also across hosts
        for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
            arr = np.asarray(leaf)
            out[_leaf_name(path)] = arr[..., :rank] if is_a_leaf(path) else arr[..., :rank, :]
        return out

    # ------------------------------------------------------------------ training

    def forward_backward(self, requests: list[ForwardBackwardInput]) -> list[ForwardBackwardResult | InputError]:
        results: list[ForwardBackwardResult | InputError | None] = [None] * len(requests)
        rows: list[Row] = []
        spans: dict[int, tuple[int, int]] = {}
        for r, req in enumerate(requests):
            try:
                self._check_slot(req.slot)
                new = forward_backward_rows(
                    req, slot_scale=self._scale(req.slot), vocab=self.info.vocab_size,
                    max_len=self.info.max_position_embeddings,
                )  # fmt: skip
            except InputError as e:
                results[r] = e
                continue
            spans[r] = (len(rows), len(rows) + len(new))
            rows.extend(new)
        if rows:
            t0 = time.perf_counter()
            self._grads, outputs = run_rows(self._steps, self._lora, self._base, self._grads, rows, self.micro_batch_tokens)
            log.debug("forward_backward: %d rows in %.3fs", len(rows), time.perf_counter() - t0)
            for r, (lo, hi) in spans.items():
                per_datum = []
                total = 0.0
                for i in range(lo, hi):
                    o = outputs[i]
                    shape_1d = requests[r].data[i - lo].inputs["target_tokens"]
                    lp = o.target_logprobs if np.ndim(shape_1d) == 2 else o.target_logprobs[:, 0]
                    per_datum.append({"logprobs": lp.astype(np.float32), "elementwise_loss": o.token_loss.astype(np.float32)})
                    total += float(np.sum(o.token_loss, dtype=np.float64))
                results[r] = ForwardBackwardResult(outputs=per_datum, metrics={"loss:sum": total})
        return results  # type: ignore[return-value]

    def optim_step(self, slot: int, adam: AdamConfig) -> dict[str, float]:
        self._check_slot(slot)
        values = (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm)
        if not all(np.isfinite(v) for v in values) or adam.learning_rate < 0 or adam.eps < 0:
            raise InputError(f"invalid AdamConfig {adam}")
        if not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
            raise InputError(f"AdamConfig betas must be in [0, 1), got beta1={adam.beta1} beta2={adam.beta2}")
        cfg = self._slots[slot]
        packed = pack_hparams(values, cfg.rank, (cfg.train_attn, cfg.train_mlp, cfg.train_unembed))
        # Only the slot's slice is read and written (in place, the state is donated); the outputs keep the
        # placement's shardings, and the two metrics come back in one small transfer.
        values, count, metrics = adamw_slot_values(self._lora, self._grads, self._opt, np.int32(slot), packed)
        grad_norm, step, finite = np.asarray(self._placement.to_host(metrics), np.float64).tolist()
        if not finite:
            # Refused before the weights or moments are written, so the run never holds NaN for good and keeps
            # working (a lower learning_rate, or a load_state). The step consumed its gradients as a good step does:
            # NaN ones kept in the accumulator would poison every later step.
            self._grads = self._zero_slot(self._grads, np.int32(slot))
            why = (f"the accumulated gradients are not finite (grad_norm={grad_norm}): the forward_backward calls "
                   "since the last step produced NaN or infinity, typically because earlier steps made the weights "
                   "too large" if not np.isfinite(grad_norm) else
                   f"learning_rate={adam.learning_rate} (grad_norm={grad_norm}) would make the weights not finite")
            raise InputError(f"optim_step not applied: {why}; the weights and Adam moments are unchanged and the "
                             "accumulated gradients were dropped. Lower the learning_rate, or load_state an earlier "
                             "checkpoint")
        # Only the slot's slice is written (in place, the state is donated); the outputs keep the placement's
        # shardings.
        self._lora, self._grads, self._opt = write_slot_values(
            self._lora, self._grads, self._opt, np.int32(slot), values, count, placement=self._placement
        )
        return {"grad_norm": grad_norm, "learning_rate": float(adam.learning_rate), "step": step}

    # ------------------------------------------------------------------ sampling

    @property
    def sample_slots(self) -> int:
        """Decode slots (rows decoded together) at most; smaller row buckets are powers of 8 below it."""
        return self._sampler.max_slots

    @sample_slots.setter
    def sample_slots(self, value: int) -> None:
        self._sampler.max_slots = self._placement.round_rows(int(value))

    def _lora_stack(self, keys: tuple[str, ...]) -> Any:
        """The snapshots' LoRA state stacked on a leading axis [len(keys) padded to a power of two, at least 1]."""
        if self._stack_cache is not None and self._stack_cache[0] == keys:
            return self._stack_cache[1]
        size = round_up_pow2(len(keys))
        snaps = tuple(self._snapshots[k].lora for k in keys)
        stacked = self._stack(snaps, self._lora, size)
        self._stack_cache = (keys, stacked)
        return stacked

    def warm_up_sampler(
        self,
        *,
        cache_lens: tuple[int, ...] = (128,),
        prompt_lens: tuple[int, ...] = (16, 32, 64),
        num_adapters: tuple[int, ...] = (1,),
        prompt_logprobs: tuple[bool, ...] = (False,),
    ) -> None:
        """Compile the sampler's decode chunk and admissions for every slot bucket, ahead of traffic: for each cache
        length bucket (a power of two >= 128: prompt + max_tokens), prompt bucket (16, 24, 32, 48, 64, ...) and
        adapter-stack size (distinct snapshots in a batch, a power of two). Default stop lists (<= 8 ids)."""
        t0 = time.perf_counter()
        before = self._sampler.compile_count()
        for n in num_adapters:
            lora = self._stack((), self._lora, round_up_pow2(n))
            self._sampler.warm_up(lora, self._base, cache_lens=cache_lens, prompt_lens=prompt_lens,
                                  stop_width=MIN_STOP_IDS, prompt_logprobs=prompt_logprobs)  # fmt: skip
        log.info("sampler warm-up: %d programs in %.1fs", self._sampler.compile_count() - before,
                 time.perf_counter() - t0)  # fmt: skip

    def sample(self, requests: list[SampleInput]) -> list[SampleResult | InputError]:
        results: list[SampleResult | InputError | None] = [None] * len(requests)
        max_len = self.info.max_position_embeddings
        valid: list[tuple[int, np.ndarray]] = []
        for r, req in enumerate(requests):
            try:
                if req.snapshot is not None and self.snapshot_evicted(req.snapshot):
                    raise InputError(evicted_message(req.snapshot, self._snapshots.budget_bytes))
                prompt = check_sample(req, vocab=self.info.vocab_size, max_len=max_len, snapshots=set(self._snapshots))
            except InputError as e:
                results[r] = e
                continue
            valid.append((r, prompt))
        if not valid:
            return results  # type: ignore[return-value]

        keys = tuple(dict.fromkeys(s for r, _ in valid if (s := requests[r].snapshot) is not None))
        stack_index = {k: i for i, k in enumerate(keys)}
        rows: list[SampleRow] = []
        owner: list[int] = []
        for r, p in valid:
            req = requests[r]
            seed = seed_words(int(req.seed if req.seed is not None else secrets.randbits(64)))
            stops = list(self.info.eos_token_ids) if req.stop_token_ids is None else list(req.stop_token_ids)
            snap = self._snapshots[req.snapshot] if req.snapshot is not None else None
            for j in range(req.num_samples):
                rows.append(SampleRow(
                    prompt=p, max_tokens=min(req.max_tokens, max_len - len(p)), temperature=float(req.temperature),
                    top_k=int(req.top_k), top_p=float(req.top_p), seed=seed, sample_index=j, stop_ids=stops,
                    adapter=stack_index[req.snapshot] if req.snapshot is not None else -1,
                    scale=snap.scale if snap is not None else 0.0,
                    prompt_logprobs=(bool(req.include_prompt_logprobs) or req.topk_prompt_logprobs > 0) and j == 0,
                    topk_prompt_logprobs=int(req.topk_prompt_logprobs) if j == 0 else 0,
                    stop_strings=list(req.stop_strings),
                ))  # fmt: skip
                owner.append(r)

        t0 = time.perf_counter()
        outputs = self._sampler.run(rows, self._lora_stack(keys), self._base)
        log.debug("sample: %d rows in %.3fs", len(rows), time.perf_counter() - t0)
        for r, _ in valid:
            results[r] = SampleResult(sequences=[])
        for r, out in zip(owner, outputs):
            res = cast(SampleResult, results[r])  # made just above for every row that has outputs
            res.sequences.append(SampledSequence(tokens=out.tokens, logprobs=out.logprobs, stop_reason=out.stop_reason))
            if out.prompt_logprobs is not None and requests[r].include_prompt_logprobs:
                res.prompt_logprobs = [None] + out.prompt_logprobs
            if out.topk_prompt_logprobs is not None:
                res.topk_prompt_logprobs = _pad_first_position(*out.topk_prompt_logprobs)
        return results  # type: ignore[return-value]


def _pad_first_position(ids: np.ndarray, lps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows for prompt positions 1..P-1 -> P rows, row 0 the SDK's padding (nothing predicts token 0)."""
    k = ids.shape[1]
    return (np.concatenate([np.zeros((1, k), np.int32), ids.astype(np.int32)]),
            np.concatenate([np.full((1, k), TOPK_PAD_LOGPROB, np.float32), lps.astype(np.float32)]))


def default_dtype() -> Any:
    """float32 on CPU (faster there than bf16, and exact parity); bfloat16 weights on GPU/TPU."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(jnp.bfloat16)


def _weight_dtype(dtype: Any) -> Any:
    if dtype is None:
        return default_dtype()
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"dtype {dtype} is not supported for base weights (float32, bfloat16 or float16)")
    return dtype


def _base_dtype(base: Any) -> Any:
    """The dtype of the base matrices, read off the embedding (norms are always float32)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]:
        if "embed_tokens" in _leaf_name(path):
            return leaf.dtype
    raise ValueError("base state has no embed_tokens")


def _leaf_name(path: tuple) -> str:
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    return ".".join(str(k) for k in keys if k != "value")
