"""The typed vocabulary of the run <-> Coordinator <-> JAX worker protocol: the kinds of work, the LoRA and Adam
specs, and one small frozen dataclass of parameters per kind.

Workflow code (stdlib only). Enums are `str`-valued so the JSON in Temporal history holds the same strings as before
they existed ("forward_backward", ...). Histories recorded before typed parameters carry a `params` dict instead;
the `from_legacy_*` converters at the end read those, and nothing else in the code looks at a dict.

Adding a kind of engine work: a member of `WorkKind` (plus its parameter type here, if it has any), its routing in
`coordinator/placement.py` (`SLOT_KINDS` if it acts on a run's adapter slot, else a branch of `PlacementPolicy.route`),
a label in KIND_LABELS below, and its handler in `activities/engine_activities.py` (`EngineActivities.handlers`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class WorkKind(str, enum.Enum):  # noqa: UP042  (StrEnum changes str(member); kept until its uses in history/messages are audited)
    """What a WorkItem asks the JAX worker to do."""

    CREATE_ADAPTER = "create_adapter"
    FREE_ADAPTER = "free_adapter"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SNAPSHOT = "snapshot"
    DROP_SNAPSHOTS = "drop_snapshots"
    SAMPLE = "sample"
    SAVE_CHECKPOINT = "save_checkpoint"
    LOAD_CHECKPOINT = "load_checkpoint"
    LOAD_SNAPSHOT = "load_snapshot"
    # Adapters between the device's training slots and the worker's page store, ahead of the batch that needs them.
    PAGE = "page"

    def __str__(self) -> str:  # f-strings and log lines show "forward_backward", not "WorkKind.FORWARD_BACKWARD"
        return self.value


class OpKind(str, enum.Enum):  # noqa: UP042  (StrEnum changes str(member); kept until its uses in history/messages are audited)
    """What an SDK request on a training client (a TrainingOp) is."""

    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    LOAD_WEIGHTS = "load_weights"
    # a request the API refused; it fails its own future in sequence (docs/architecture.md §What durability promises)
    REJECT = "reject"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LoraSpec:
    """The one LoRA spec carried from the API to the engine (the activity converts it to the engine's LoraConfig)."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    optimizer: str = "adamw"  # "adamw" | "dimuon": the run's optimizer family, fixed at its creation


@dataclass(frozen=True)
class AdamSpec:
    """The hyper-parameters of one optim_step (the activity converts it to the engine's config): torch.optim.AdamW's,
    or with `optimizer` "dimuon" Dimuon's (learning_rate, beta1, grad_clip_norm, damping,
    rank_lr_correction_exponent; beta2, eps and weight_decay unused)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    optimizer: str = "adamw"
    damping: float = 1.0
    rank_lr_correction_exponent: float = 0.5


@dataclass(frozen=True)
class SampleParams:
    """A sample item: which sampler asked, and its work (the Coordinator counts its queue in samples and tokens)."""

    sampler_id: str = ""
    samples: int = 1  # samples asked for (1 from API processes that did not count them)
    work: int = 0  # samples x (prompt + max_tokens) tokens; 0 when unknown


@dataclass(frozen=True)
class DropSnapshots:
    """Drop in-memory sampler snapshots: the named keys on one worker's queue, or (as sessions ask) all under a
    prefix, which the Coordinator resolves into keys from its record before dispatch."""

    keys: list[str] | None = None
    queue: str = ""
    prefix: str = ""


@dataclass(frozen=True)
class SaveCheckpoint:
    """Write a run's adapter (and optimizer state) as the checkpoint `path`; `manifest` is its JSON document."""

    path: str
    manifest: dict[str, Any] = field(default_factory=dict[str, Any])
    overwrite: bool = False
    age_recipients: list[str] = field(default_factory=list[str])


@dataclass(frozen=True)
class LoadCheckpoint:
    """Load the checkpoint `path`: into the run's slot (load_checkpoint) or as a sampler snapshot (load_snapshot)."""

    path: str
    optimizer: bool = False


@dataclass(frozen=True)
class SlotMove:
    """One run's adapter and the training slot it leaves (page_out) or enters (page_in)."""

    model_id: str
    slot: int


@dataclass(frozen=True)
class PageMoves:
    """What the Coordinator asks a worker to page before a batch, in this order: the `page_out` adapters leave their
    slots for the worker's page store, the `page_in` ones enter the freed slots, the `drop` ones are forgotten."""

    page_out: list[SlotMove] = field(default_factory=list[SlotMove])
    page_in: list[SlotMove] = field(default_factory=list[SlotMove])
    drop: list[str] = field(default_factory=list[str])


@dataclass(frozen=True)
class TenantLimit:
    """Carried by a create_adapter: whose run it is, and how many live runs that owner may hold on one base model
    (0: no limit). The Coordinator refuses the create past it."""

    owner: str
    max_live_runs: int = 0


@dataclass(frozen=True)
class SaveRequest:
    """What the SDK asked of save_weights / save_weights_for_sampler / save_weights_external."""

    path: str | None = None  # the checkpoint name (None: an ephemeral sampler snapshot)
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict[str, Any])
    overwrite: bool = False
    age_recipients: list[str] = field(default_factory=list[str])
    # kind="inflight" (the SDK's SamplingClientKind): the run's one mutable sampler target, not a snapshot
    inflight: bool = False


# How the Coordinator names each kind in a batch's summary (the Temporal UI).
KIND_LABELS = {
    WorkKind.FORWARD_BACKWARD: "fwd/bwd",
    WorkKind.OPTIM_STEP: "optim",
    WorkKind.SAMPLE: "sample",
    WorkKind.SNAPSHOT: "snapshot",
    WorkKind.CREATE_ADAPTER: "create adapter",
    WorkKind.FREE_ADAPTER: "free adapter",
    WorkKind.DROP_SNAPSHOTS: "drop snapshots",
    WorkKind.SAVE_CHECKPOINT: "save checkpoint",
    WorkKind.LOAD_CHECKPOINT: "load checkpoint",
    WorkKind.LOAD_SNAPSHOT: "load sampler weights",
    WorkKind.PAGE: "page adapters",
}


# --- histories written before typed parameters -------------------------------------------------------------------


def from_legacy_lora(p: dict[str, Any]) -> LoraSpec:
    return LoraSpec(
        rank=int(p["rank"]),
        seed=p.get("seed"),
        train_attn=bool(p.get("train_attn", True)),
        train_mlp=bool(p.get("train_mlp", True)),
        train_unembed=bool(p.get("train_unembed", True)),
    )


def from_legacy_adam(p: dict[str, Any]) -> AdamSpec:
    names = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    values: dict[str, Any] = {k: float(p[k]) for k in names if k in p}
    return AdamSpec(**values)


def from_legacy_save_request(p: dict[str, Any]) -> SaveRequest:
    seq = p.get("sampling_session_seq_id")
    ttl = p.get("ttl_seconds")
    return SaveRequest(
        path=p.get("path"),
        sampling_session_seq_id=None if seq is None else int(seq),
        ttl_seconds=None if ttl is None else int(ttl),
        user_metadata=dict(p.get("user_metadata") or {}),
        overwrite=bool(p.get("overwrite")),
        age_recipients=list(p.get("age_recipients") or []),
    )


def from_legacy_load(p: dict[str, Any]) -> LoadCheckpoint:
    return LoadCheckpoint(path=str(p["path"]), optimizer=bool(p.get("optimizer")))


def from_legacy_work_params(kind: WorkKind, p: dict[str, Any]) -> dict[str, Any]:
    """A WorkItem's legacy `params` dict as the typed fields that replace it (field name -> value)."""
    if kind is WorkKind.CREATE_ADAPTER:
        return {"lora": from_legacy_lora(p)}
    if kind is WorkKind.OPTIM_STEP:
        return {"adam": from_legacy_adam(p)}
    if kind is WorkKind.SNAPSHOT:
        return {"snapshot": str(p["key"])}
    if kind is WorkKind.SAMPLE:
        return {
            "snapshot": str(p.get("snapshot") or ""),
            "sample": SampleParams(
                sampler_id=str(p.get("sampler_id") or ""), samples=int(p.get("samples", 1)), work=int(p.get("work", 0))
            ),
        }
    if kind is WorkKind.DROP_SNAPSHOTS:
        keys = p.get("keys")
        return {
            "drop": DropSnapshots(
                keys=None if keys is None else list(keys),
                queue=str(p.get("queue") or ""),
                prefix=str(p.get("prefix") or ""),
            )
        }
    if kind is WorkKind.SAVE_CHECKPOINT:
        return {
            "save": SaveCheckpoint(
                path=str(p["path"]),
                manifest=dict(p.get("manifest") or {}),
                overwrite=bool(p.get("overwrite")),
                age_recipients=list(p.get("age_recipients") or []),
            )
        }
    if kind in (WorkKind.LOAD_CHECKPOINT, WorkKind.LOAD_SNAPSHOT):
        return {"load": from_legacy_load(p)}
    return {}  # free_adapter, forward_backward: no parameters
