"""The frozen dataclasses Temporal carries between the API, the workflows and the JAX worker's activities.

Only small control fields travel inline; request bodies and results travel as `BlobRef`s into the claim-check store
(docs/architecture.md §The claim-check data path). Keep every field JSON-friendly (str, int, float, bool, dict, list,
other dataclasses here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinkerflow.workflows.protocol.usage import OpUsage
from tinkerflow.workflows.protocol.work import (
    AdamSpec,
    DropSnapshots,
    LoadCheckpoint,
    LoraSpec,
    OpKind,
    PageMoves,
    SampleParams,
    SaveCheckpoint,
    SaveRequest,
    SlotMove,
    TenantLimit,
    WorkKind,
    from_legacy_adam,
    from_legacy_load,
    from_legacy_save_request,
    from_legacy_work_params,
)

__all__ = [
    "AdamSpec",
    "DropSnapshots",
    "LoadCheckpoint",
    "LoraSpec",
    "OpKind",
    "PageMoves",
    "SampleParams",
    "SaveCheckpoint",
    "SaveRequest",
    "SlotMove",
    "TenantLimit",
    "WorkKind",
]  # re-exported: the protocol's vocabulary lives in work.py


@dataclass(frozen=True)
class BlobRef:
    uri: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelCard:
    """What a JAX worker serves, as the API reports it to the SDK."""

    name: str  # the base_model string clients send (HF id or local path)
    arch: str
    local_path: str  # resolved directory holding config, weights and tokenizer
    vocab_size: int
    max_context: int
    # A vision-language model's image processor settings (its preprocessor_config.json) the API checks ImageChunks
    # with; None: the model has no vision tower and takes text only.
    image_processor: dict[str, Any] | None = None


@dataclass(frozen=True)
class Outcome:
    """The answer a future resolves to: a JSON result, a protobuf result in the store, or an error."""

    json: dict[str, Any] | None = None
    blob: BlobRef | None = None
    error: str = ""
    category: str = ""  # "user" | "server" when error is set
    worker_lost: bool = False  # failed because the JAX worker holding the adapter died or restarted
    usage: OpUsage | None = None  # what the op consumed, counted by the JAX worker (workflows/protocol/usage.py)

    @property
    def ok(self) -> bool:
        return not self.error

    @staticmethod
    def failed(message: str, category: str = "user") -> Outcome:
        return Outcome(error=message, category=category)


# --- sessions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionStart:
    session_id: str
    owner: str  # hash of the API key that created it ("" when the API is open)
    tags: list[str] = field(default_factory=list[str])
    user_metadata: dict[str, Any] = field(default_factory=dict[str, Any])
    sdk_version: str = ""
    heartbeat_timeout_s: float = 120.0
    display_name: str = ""


@dataclass(frozen=True)
class SamplerInfo:
    sampler_id: str
    base_model: str
    model_path: str = ""  # tinker:// path it was created from, if any
    snapshot: str = ""  # engine snapshot key ("" samples the base model)
    source_model_id: str = ""
    pool: str = "default"
    owner: str = ""  # the session owner's key hash; only that tenant may sample it


@dataclass(frozen=True)
class SamplerRequest:
    seq: int
    base_model: str
    model_path: str = ""
    pool: str = "default"


@dataclass(frozen=True)
class SampleStart:
    """A batch of asample calls on one sampler that arrived together at one API process."""

    sampler: SamplerInfo
    payloads: list[BlobRef]
    # Per payload: samples asked for, and their work in tokens (samples x (prompt + max_tokens)); the coordinator
    # counts its queue in these, not in calls. Empty from API processes older than this field.
    samples: list[int] = field(default_factory=list[int])
    work: list[int] = field(default_factory=list[int])


@dataclass
class SessionState:
    session_id: str
    owner: str
    status: str = "active"  # active | finished | timed_out
    reason: str = ""
    training_run_ids: list[str] = field(default_factory=list[str])
    samplers: dict[str, SamplerInfo] = field(default_factory=dict[str, SamplerInfo])
    user_metadata: dict[str, Any] = field(default_factory=dict[str, Any])
    heartbeats: int = 0
    display_name: str = ""
    project_id: str = ""
    sampler_clients: dict[str, int] = field(default_factory=dict[str, int])  # sampler -> clients joined so far


# --- training runs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunStart:
    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora: LoraSpec
    pool: str = "default"
    user_metadata: dict[str, Any] = field(default_factory=dict[str, Any])
    # Create-via-load (docs/wire-contract.md §Training routes): the adapter starts from this checkpoint instead of a
    # fresh init.
    load_path: str = ""
    load_optimizer: bool = False
    # Save an automatic training-state snapshot every this many optim steps (0: never); with the ops logged since, it
    # restores the adapter exactly on another worker if its JAX worker dies (docs/architecture.md §What durability
    # promises).
    snapshot_every: int = 0
    # The most live training runs the owner may hold on this base model (the API's --max-live-runs-per-tenant; 0: no
    # limit); the Coordinator refuses this run's create past it.
    max_live_runs: int = 0


@dataclass(frozen=True)
class TrainingOp:
    """One SDK request on a training client. `seq_id` orders it; `body_hash` tells a retry from a conflicting reuse.

    Its parameters are typed per kind: `adam` (optim_step), `save` (the three saves), `load` (load_weights), `error`
    (reject). `kind` stays a plain string when it is none of OpKind's (an API newer than this worker): the op then
    fails through its future instead of at submit (docs/architecture.md §What durability promises)."""

    seq_id: int
    kind: OpKind | str
    body_hash: str
    payload: BlobRef | None = None  # forward_backward: the request body in the claim-check store
    params: dict[str, Any] = field(
        default_factory=dict[str, Any]
    )  # legacy (before typed fields): read by __post_init__
    owner: str = ""  # the caller's key hash; must be the run's owner
    adam: AdamSpec | None = None
    save: SaveRequest | None = None
    load: LoadCheckpoint | None = None
    error: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OpKind) and self.kind in OpKind._value2member_map_:
            object.__setattr__(self, "kind", OpKind(self.kind))
        if not self.params:
            return
        p = self.params
        typed: dict[str, Any] = {}
        if self.kind is OpKind.OPTIM_STEP:
            typed["adam"] = from_legacy_adam(p)
        elif self.kind in (OpKind.SAVE_WEIGHTS, OpKind.SAVE_WEIGHTS_FOR_SAMPLER, OpKind.SAVE_WEIGHTS_EXTERNAL):
            typed["save"] = from_legacy_save_request(p)
        elif self.kind is OpKind.LOAD_WEIGHTS and p.get("path"):
            typed["load"] = from_legacy_load(p)
        elif self.kind is OpKind.REJECT:
            typed["error"] = str(p.get("error", "rejected"))
        for name, value in typed.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "params", {})


@dataclass(frozen=True)
class Answered:
    body_hash: str
    outcome: Outcome


@dataclass
class RunState:
    """Everything a person wants to see about a run, and everything continue-as-new must carry."""

    start: RunStart
    next_seq: int = 1
    step: int = 0
    fwdbwd_count: int = 0
    tokens_seen: int = 0
    last_loss: float | None = None
    status: str = "starting"  # starting | ready | failed | closed
    error: str = ""
    # str(seq_id) -> first answer of recent ops, so a retried seq_id gets the first answer even after
    # continue-as-new (Temporal's own update-id dedupe is per run). String keys: history is JSON.
    answered: dict[str, Answered] = field(default_factory=dict[str, Answered])
    sampler_count: int = 0
    last_request_time: str = ""  # RFC3339, for the REST TrainingRun
    last_checkpoint: str = ""  # tinker:// path of the newest save_state
    last_sampler_checkpoint: str = ""  # tinker:// path of the newest named sampler weights
    loaded_from: str = ""  # the last checkpoint loaded into this run
    lora: LoraSpec | None = None  # set at create (a seed drawn when none was given) and by loads
    # Recovery (docs/architecture.md §What durability promises): the latest automatic snapshot, and the state-changing
    # ops since (refs and params only).
    auto_snapshot: str = ""
    since_snapshot: list[LoggedOp] = field(default_factory=lambda: list[LoggedOp]())
    recoveries: int = 0
    usage: dict[str, OpUsage] = field(default_factory=dict[str, OpUsage])  # UTC hour -> metered (usage.py)

    @property
    def lora_spec(self) -> LoraSpec:
        return self.lora or self.start.lora


@dataclass(frozen=True)
class LoggedOp:
    """A state-changing op since a run's last automatic snapshot, as recovery replays it onto a fresh adapter:
    forward_backward (payload), optim_step (adam) or load_checkpoint (load)."""

    kind: WorkKind | str  # str only while reading a legacy entry (whose loads say "load_weights")
    payload: BlobRef | None = None
    adam: AdamSpec | None = None
    load: LoadCheckpoint | None = None
    params: dict[str, Any] = field(
        default_factory=dict[str, Any]
    )  # legacy (before typed fields): read by __post_init__

    def __post_init__(self) -> None:
        kind = WorkKind.LOAD_CHECKPOINT if self.kind == "load_weights" else WorkKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if self.params:
            for name, value in from_legacy_work_params(kind, self.params).items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "params", {})


# --- the coordinator and the JAX worker ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    task_queue: str
    max_adapters: int
    max_rank: int
    card: ModelCard
    incarnation: str = ""  # new at every process start: a batch meant for a dead process is refused by its successor
    # Adapters it can hold paged out besides its slots (host memory and files: --adapter-host-memory-mb,
    # --adapter-disk-mb). 0: a worker that does not page (or one older than paging): it holds max_adapters runs.
    max_paged: int = 0
    # Batches it takes at once and runs one after another in the order they were dispatched (`Batch.after`), so the
    # Coordinator queues its next batch while one runs. 0: one at a time (a worker older than pipelining).
    pipeline_depth: int = 0


@dataclass(frozen=True)
class WorkItem:
    """A unit of engine work a requester workflow hands the coordinator; the answer comes back as a signal.

    Parameters are typed per kind (work.py): `lora` (create_adapter), `adam` (optim_step), `snapshot` (the key a
    snapshot writes, or a sample reads; "" samples the base model), `sample`, `drop` (drop_snapshots), `save`
    (save_checkpoint), `load` (load_checkpoint, load_snapshot), `page` (page), `tenant` (create_adapter)."""

    key: str  # unique: "<requester workflow id>#<n>"
    requester: str  # workflow id to signal the WorkResult to
    kind: WorkKind
    model_id: str = ""
    session_id: str = ""
    payload: BlobRef | None = None
    params: dict[str, Any] = field(
        default_factory=dict[str, Any]
    )  # legacy (before typed fields): read by __post_init__
    slot: int = -1  # filled in by the coordinator before dispatch; -1 on a free_adapter of a paged-out run
    lora: LoraSpec | None = None
    adam: AdamSpec | None = None
    snapshot: str = ""
    sample: SampleParams | None = None
    drop: DropSnapshots | None = None
    save: SaveCheckpoint | None = None
    load: LoadCheckpoint | None = None
    # A training op's place in its run, so the JAX worker can record its metric point (tinkerflow.common.run_metrics):
    # the op's seq_id (None: not an SDK op, e.g. a recovery replay, which records nothing) and the optimizer steps the
    # run had completed when it ran.
    seq_id: int | None = None
    step: int = 0
    page: PageMoves | None = None
    tenant: TenantLimit | None = None

    def __post_init__(self) -> None:
        kind = WorkKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if self.params:
            for name, value in from_legacy_work_params(kind, self.params).items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "params", {})


@dataclass(frozen=True)
class WorkResult:
    key: str
    outcome: Outcome
    delivered: bool = False  # the JAX worker already signalled it to the requester


@dataclass(frozen=True)
class Batch:
    items: list[WorkItem]
    incarnation: str = ""  # the worker process this batch was placed for
    # Pipelined dispatch: this batch's name, and the batch dispatched to the same worker just before it and still in
    # flight then ("": none), which the worker runs first.
    batch_id: str = ""
    after: str = ""


@dataclass(frozen=True)
class BatchResult:
    results: list[WorkResult]
