"""The engine's boundary: plain numpy-in, numpy-out types the activities convert to and from wire formats.

Nothing here knows about Temporal, HTTP or protobuf; nothing outside the engine knows about jax. Shapes follow the
Tinker convention: a datum's `tokens` has N entries and every loss input has leading dimension N (position i of the
input predicts `target_tokens[i]`; the caller already shifted by one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tinkerflow.common.errors import InputError  # noqa: F401  (the taxonomy's; raised by this name)
from tinkerflow.common.images import ProcessedImage

from .shape_buckets import round_up_pow4, train_seq_len

OptimizerName = Literal["adamw", "dimuon"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("adamw", "dimuon")


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    # The optimizer family, fixed for the adapter's life (Tinker's optimizer_config): it decides which step
    # optim_step takes and what the saved moments mean.
    optimizer: OptimizerName = "adamw"


@dataclass(frozen=True)
class SlotState:
    """An adapter slot's whole training state (Engine.export_slot / import_slot): LoRA weights A [in, rank] and
    B [rank, out] by module name as in Engine.adapter_weights, the optimizer's moments (same names and shapes) and
    its step. AdamW: mu and nu. Dimuon: mu is its momentum, nu stays zero."""

    config: LoraConfig
    weights: dict[str, np.ndarray]
    mu: dict[str, np.ndarray]
    nu: dict[str, np.ndarray]
    step: int


@dataclass(frozen=True)
class AdamConfig:
    """torch.optim.AdamW semantics (bias correction, decoupled weight decay); grad_clip_norm 0 means no clipping."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class DimuonConfig:
    """One Dimuon step (training/dimuon.py): momentum beta1, then per LoRA matrix a row- and column-preconditioned
    matrix sign, scaled to Frobenius norm sqrt(rank) and by the rank correction (rank / 32) ** exponent.
    grad_clip_norm <= 0 means no clipping; damping (> 0) smooths the row and column preconditioners."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    damping: float = 1.0
    rank_lr_correction_exponent: float = 0.5


@dataclass
class Datum:
    tokens: np.ndarray  # int32 [N]
    inputs: dict[str, np.ndarray]  # e.g. target_tokens int64 [N], weights float32 [N], advantages, logprobs
    # From the datum's provenance (loss_fn_input_spans): 1.0 on target positions that are sampled tokens
    # (a SampledProvenanceSpan covers them); None when the datum carries no provenance.
    sampled_mask: np.ndarray | None = None
    # The datum's images in the order of their placeholder runs in `tokens` (each image is `image.tokens`
    # consecutive ModelInfo.image_token_id tokens there): patch rows and grid as the model's image processor cut them.
    images: tuple[ProcessedImage, ...] = ()


@dataclass
class ForwardBackwardInput:
    slot: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


@dataclass
class ForwardBackwardResult:
    outputs: list[dict[str, np.ndarray]]  # one dict per datum; always has "logprobs" shaped like target_tokens
    metrics: dict[str, float]  # keys are "<name>:<reduction>", always includes "loss:sum"


@dataclass
class SampleInput:
    prompt: np.ndarray  # int32 [P]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    # The stop rule (docs/wire-contract.md §Sampling): None stops at the model's EOS; [] with no stop strings never
    # stops; otherwise any of these token ids or strings stops, and EOS still does.
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] = field(default_factory=list)
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0  # k > 0: the k most likely tokens (ids, log-probs) at every prompt position
    snapshot: str | None = None  # sampler snapshot key; None samples the base model
    topk_sample_logprobs: int = 0  # k > 0: the k most likely tokens (ids, log-probs) at every sampled position
    # int64 [P - 1, K]: row i names token ids to score at prompt position i + 1 (-1: none); None: not asked
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens_k: int = 0  # k > 0: k draws at the request's temperature at every prompt position after 0
    prompt_logprobs_last_n: int | None = None  # score only the last N prompt tokens (earlier entries None)
    # Prompts of one namespace (a sampling session) share prefix-cache blocks; None: this request is not cached.
    cache_namespace: str | None = None
    # The prompt's images in the order of their placeholder runs (as `Datum.images`): the tower's features take the
    # place of their placeholder tokens' embeddings.
    images: tuple[ProcessedImage, ...] = ()


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk_logprobs: tuple[np.ndarray, np.ndarray] | None = None  # ids int32, log-probs float32 [len(tokens), k]


TOPK_PAD_LOGPROB = -99999.0  # the SDK's TopkLogprobs sentinel (tinker.types.topk_logprobs.MASK_LOGPROB)


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # None at position 0
    # (token ids int32 [P, k], log-probs float32 [P, k]); row 0 (nothing predicts the first token) is padding:
    # id 0, log-prob TOPK_PAD_LOGPROB, as the SDK's TopkLogprobs expects.
    topk_prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    target_prompt_logprobs: np.ndarray | None = None  # float32 [P - 1, K], 0.0 where the request had -1
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None  # ids int64, log-probs float32 [P - 1, k]
    prompt_cache_hit_tokens: int = 0  # prompt tokens of the first sample served from the prefix cache


@dataclass(frozen=True)
class ModelInfo:
    arch: str  # the model family (model/families/<arch>/)
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    # The placeholder token an image's features take the place of; None: the model runs no vision tower.
    image_token_id: int | None = None


@dataclass(frozen=True)
class SamplerWarmUp:
    """The sampler families the warm-up compiles, each for every slot bucket (whose cache lengths are fixed:
    sampling/buckets.py). A family serves every prompt length, stop list and top-k: it is an adapter-stack
    size (distinct snapshots in one decode batch: 1, 4 or 16) and whether its admissions score prompts. The
    defaults are the whole set, the first user's family (one snapshot, no scoring) first."""

    num_adapters: tuple[int, ...] = (1, 4, 16)
    scoring: tuple[bool, ...] = (False, True)


@dataclass(frozen=True)
class TrainWarmUp:
    """forward_backward / forward buckets compiled ahead of traffic: every (rows, sequence) pair whose tokens fit
    `token_budget` (a micro-batch's). Rows are rounded up to powers of four, sequence lengths to the row lengths
    256, 1,024, 4,096 (shape_buckets.py train_seq_len). The defaults are the whole set for datums up to 4,096
    tokens at the default budget: what any mix of such datums runs."""

    rows: tuple[int, ...] = (1, 4, 16, 64)
    seq_lens: tuple[int, ...] = (256, 1024, 4096)
    token_budget: int = 16384


@dataclass(frozen=True)
class WarmUpPlan:
    train: TrainWarmUp = field(default_factory=TrainWarmUp)
    sampler: SamplerWarmUp = field(default_factory=SamplerWarmUp)

    def pieces(self) -> tuple[WarmUpPiece, ...]:
        """In the order a first user needs them: the training half of an adapter's lifecycle at the smallest
        shapes (create, forward_backward, optim_step), the train bucket of a first batch of several datums (the most
        rows at the shortest sequence) and the lifecycle's own (its forward step), the first sampler family and the
        rest of the lifecycle (export, import, snapshot, sample): these `first_user` pieces;
        then the other train buckets, then the other sampler families. With `--warm-up background` the JAX worker
        runs the lifecycle's training half before it registers, the other first-user pieces right after, back to
        back, and the rest in the pauses of the traffic."""
        rows = sorted({round_up_pow4(r) for r in self.train.rows})
        lens = sorted({train_seq_len(n) for n in self.train.seq_lens})
        s = self.sampler
        families = [WarmUpPiece("sampler", adapters=a, scoring=sc) for a in s.num_adapters for sc in s.scoring]
        budget = self.train.token_budget
        fits = [r for r in rows if r * lens[0] <= budget] or rows[:1]
        trains = [WarmUpPiece("train", rows=r, seq=n) for n in lens for r in rows if r * n <= budget or r == rows[0]]
        first_batches = [
            WarmUpPiece("train", rows=fits[-1], seq=lens[0]),
            WarmUpPiece("train", rows=rows[0], seq=lens[0]),
        ]
        out = [WarmUpPiece("lifecycle", rows=rows[0], seq=lens[0]), *first_batches]
        out += families[:1] + [WarmUpPiece("lifecycle_sample")] + trains + families[1:]
        return tuple(dict.fromkeys(out))

    def first_user(self) -> int:
        """How many leading pieces (of `pieces`) a first user needs: up to the sampling half of the lifecycle."""
        return 1 + [p.kind for p in self.pieces()].index("lifecycle_sample")


# The pieces Engine.compile_ahead builds from shapes alone: they only compile, so they need no turn on the engine.
COMPILE_ONLY_KINDS = frozenset({"train", "sampler"})


@dataclass(frozen=True)
class WarmUpPiece:
    kind: Literal["lifecycle", "lifecycle_sample", "train", "sampler"]
    rows: int = 0
    seq: int = 0
    adapters: int = 1
    scoring: bool = False
    slots: int = 0  # a sampler piece: one slot bucket of the family (0: every bucket)


@dataclass(frozen=True)
class PageMoves:
    """Adapters to move between the device's training slots and the worker's page store (Engine.page), in this
    order: every `page_out` (slot, key) copies a resident adapter out and frees its slot; every `page_in` (key, slot)
    writes a paged-out adapter into a free slot; every `drop` key forgets a paged-out adapter (its run ended)."""

    page_out: tuple[tuple[int, str], ...] = ()
    page_in: tuple[tuple[str, int], ...] = ()
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class PageReport:
    """What Engine.page did: the keys it could not move (with why: that adapter is lost on this worker), each move's
    seconds, where each page-in came from, and the page store's state after."""

    failed: dict[str, str] = field(default_factory=dict)
    out_seconds: tuple[float, ...] = ()
    in_seconds: tuple[float, ...] = ()
    in_tiers: tuple[str, ...] = ()  # "host" | "disk", per page-in
    resident: int = 0  # training slots holding an adapter
    paged: int = 0  # adapters in the page store
    host_bytes: int = 0
    disk_bytes: int = 0
