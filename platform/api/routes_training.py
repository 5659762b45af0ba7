"""Training routes: create_model, get_info, forward_backward, optim_step, saves and loads (docs/wire-contract.md
§Training routes).

Every in-sequence request becomes an Update on its run's workflow carrying its `seq_id`; the answer is a request_id
naming that update. A request the adapter can already tell is wrong, but which has a seq_id, still goes in as a
`reject` op: it must consume its seq_id (docs/wire-contract.md §Ordering and idempotency), and it fails its own
future with a `user` error."""

from __future__ import annotations

import asyncio
import dataclasses

import zstandard
from fastapi import APIRouter, Depends, Request
from temporalio.client import WithStartWorkflowOperation, WorkflowUpdateStage
from temporalio.common import WorkflowIDConflictPolicy
from tinker.types import (
    CreateModelRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SaveWeightsExternalRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)

from tinkerflow.api import request_ids
from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import from_temporal, http_error
from tinkerflow.api.identifiers import check_model_id
from tinkerflow.api.image_checks import forward_backward_problem
from tinkerflow.api.lookups import json_body, run_of_caller, session_of_caller
from tinkerflow.api.op_checks import check_metadata, metadata_problem, parse, sequence_key
from tinkerflow.api.optimizers import family, optim_spec
from tinkerflow.api.protobuf_header import input_tokens, read_forward_backward_header
from tinkerflow.api.quota_checks import Refusal
from tinkerflow.api.routes_custom_loss import custom_loss_problem, is_custom
from tinkerflow.api.services import Services
from tinkerflow.api.training_ops import canonical as _canonical
from tinkerflow.api.training_ops import check_model_seq_id as _check_model_seq_id
from tinkerflow.api.training_ops import hash_body as _hash
from tinkerflow.api.training_ops import reject as _reject
from tinkerflow.api.training_ops import request_id as _request_id
from tinkerflow.api.training_ops import submit as _submit
from tinkerflow.api.training_ops import submit_save as _submit_save
from tinkerflow.common.age_export import parse_recipients
from tinkerflow.common.checkpoints import CheckpointError, check_name, check_ttl
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
    LoadCheckpoint,
    LoraSpec,
    OpKind,
    RunStart,
    SaveRequest,
    TrainingOp,
)
from tinkerflow.workflows.training_run import TrainingRunWorkflow

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    req = CreateModelRequest.model_validate(await json_body(request))
    _check_model_seq_id(req.model_seq_id)
    check_metadata(req.user_metadata)
    card = await svc.registry.get(req.base_model)
    if card is None:
        served = ", ".join(sorted(await svc.registry.cards())) or "none (is a JAX worker running?)"
        raise http_error(400, f"unknown base_model {req.base_model!r}; this server serves: {served}")
    lora = req.lora_config
    rank = lora.rank if lora else 32
    if rank < 1 or rank > svc.settings.max_lora_rank:
        raise http_error(
            400, f"LoRA rank {rank} is outside 1..{svc.settings.max_lora_rank} (the server's --max-lora-rank)"
        )
    optimizer, problem = family(req.optimizer_config)
    if problem:
        raise http_error(400, problem)
    await session_of_caller(svc, req.session_id, who)
    model_id = names.model_id_for(req.session_id, req.model_seq_id)
    spec = LoraSpec(
        rank=rank,
        seed=lora.seed if lora else None,
        train_attn=lora.train_attn if lora else True,
        train_mlp=lora.train_mlp if lora else True,
        train_unembed=lora.train_unembed if lora else True,
        optimizer=optimizer,
    )
    start = RunStart(
        model_id=model_id,
        session_id=req.session_id,
        owner=who,
        base_model=card.name,
        lora=spec,
        pool=svc.settings.pool,
        user_metadata=req.user_metadata or {},
        snapshot_every=svc.settings.auto_snapshot_every,
        max_live_runs=svc.settings.max_live_runs_per_tenant,
    )
    return await _start_run(svc, start, f"LoRA training run {model_id}")


async def _start_run(svc: Services, start: RunStart, summary: str) -> dict:
    """Start the run's workflow and its `create` update in one call; the future is that update."""
    spec = start.lora
    trained = "+".join(
        n for n, on in (("attn", spec.train_attn), ("mlp", spec.train_mlp), ("unembed", spec.train_unembed)) if on
    )
    start_op = WithStartWorkflowOperation(
        TrainingRunWorkflow.run,
        args=[start, None],
        id=names.run_workflow_id(start.model_id),
        task_queue=names.WORKFLOW_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=names.search_attributes(
            (names.SESSION_ID, start.session_id),
            (names.BASE_MODEL, start.base_model),
            (names.STATUS, "starting"),
            (names.STEP, 0),
            (names.OWNER, names.owner_value(start.owner)),
        ),
        static_summary=f"{summary} · rank {spec.rank} · {trained} · {start.base_model}",
    )
    async with svc.quotas.creating_run(
        svc, start.owner, names.run_workflow_id(start.model_id)
    ):  # 429 past the key's concurrent_runs
        try:
            handle = await svc.client.start_update_with_start_workflow(
                TrainingRunWorkflow.create,
                start_workflow_operation=start_op,
                id="create",
                wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            )
        except Exception as e:
            raise from_temporal(e, f"training run {start.model_id}") from None
    rid = _request_id(
        svc, request_ids.UpdateRef(handle.workflow_id, handle.workflow_run_id or "", handle.id), start.owner
    )
    return {"request_id": rid, "model_id": start.model_id}


@router.post("/get_info")
async def get_info(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    model_id = (await json_body(request)).get("model_id", "")
    state = await run_of_caller(svc, model_id, who)
    card = await svc.registry.get(state.start.base_model)
    base = state.start.base_model
    return {
        "type": "get_info",
        "model_id": model_id,
        "is_lora": True,
        "lora_rank": state.start.lora.rank,
        "model_name": base,
        # tokenizer_id = the served directory: the SDK's get_tokenizer() loads it offline (docs/wire-contract.md
        # §Tokenizer).
        "model_data": {
            "arch": card.arch if card else None,
            "model_name": base,
            "tokenizer_id": card.local_path if card else base,
        },
    }


@router.post("/forward_backward")
async def forward_backward(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    body = await request.body()
    if "zstd" in request.headers.get("content-encoding", "").lower():
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=svc.settings.max_request_bytes)
        except zstandard.ZstdError as e:
            raise http_error(400, f"body is not valid zstd (or decompresses past --max-request-bytes): {e}") from None
    try:
        # model_id, seq_id and the datum count off the top-level fields: the datums are decoded once, by the worker.
        msg = read_forward_backward_header(body)
    except ValueError as e:
        raise http_error(400, f"body is not a valid tinker_public.ForwardBackwardRequest protobuf: {e}") from None
    check_model_id(msg.model_id)
    if msg.seq_id < 0:
        raise http_error(400, "forward_backward needs a model_id and a seq_id >= 0")
    cap = svc.settings.max_datums_per_request
    problem, charge = "", None
    if msg.datums > cap:
        problem = (
            f"data has {msg.datums} datums, more than this server's limit of {cap} per request "
            "(--max-datums-per-request); send them in several calls"
        )
    elif is_custom(msg):
        problem = custom_loss_problem(svc, msg, who)
    if not problem:
        problem = await forward_backward_problem(svc, msg.model_id, body, who)
    if not problem:  # the datums' tokens are counted only for a key with a training quota
        charge = svc.quotas.admit_training(who, (msg.model_id, msg.seq_id), lambda: input_tokens(body))
        if isinstance(charge, Refusal):
            problem, charge = charge.message, None
    if problem:  # in sequence: consume the seq_id, fail the future
        op = TrainingOp(
            seq_id=msg.seq_id, kind=OpKind.REJECT, body_hash=_hash(body), error=f"forward_backward: {problem}"
        )
        return await _submit(svc, msg.model_id, op, who)
    try:
        ref = await asyncio.to_thread(svc.store.put, body, "requests")  # fsspec I/O: off the event loop
        op = TrainingOp(seq_id=msg.seq_id, kind=OpKind.FORWARD_BACKWARD, body_hash=_hash(body), payload=ref)
        return await _submit(svc, msg.model_id, op, who)
    except BaseException:
        if charge is not None:  # never accepted: not the key's usage
            svc.quotas.refund(charge)
        raise


@router.post("/optim_step")
async def optim_step(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    raw = await json_body(request)
    model_id, seq_id = sequence_key(raw, "optim_step")
    req, problem = parse(OptimStepRequest, raw, "optim_step")
    adam = None
    if req is not None:  # AdamParams or DimuonParams; whether they match the run's optimizer, the engine checks
        adam, problem = optim_spec(req.optim_params)
    if adam is None:
        return await _submit(svc, model_id, _reject(seq_id, raw, problem), who)
    op = TrainingOp(seq_id=seq_id, kind=OpKind.OPTIM_STEP, body_hash=_hash(_canonical(raw)), adam=adam)
    return await _submit(svc, model_id, op, who)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict:
    raw = await json_body(request)
    model_id, seq_id = sequence_key(raw, "save_weights_for_sampler")
    req, problem = parse(SaveWeightsForSamplerRequest, raw, "save_weights_for_sampler")
    if req is None or metadata_problem(req.user_metadata):
        if not problem:
            assert req is not None  # parse returns no request only with a problem
            problem = metadata_problem(req.user_metadata)
        return await _submit(svc, model_id, _reject(seq_id, raw, problem), who)
    save = SaveRequest(
        path=req.path,
        sampling_session_seq_id=req.sampling_session_seq_id,
        ttl_seconds=req.ttl_seconds,
        user_metadata=req.user_metadata or {},
        overwrite=True,
        inflight=req.path is None and req.kind == "inflight",
    )
    if req.path is not None:  # named: PEFT files under tinker://<model_id>/sampler_weights/<name>
        op = _checked_save(seq_id, OpKind.SAVE_WEIGHTS_FOR_SAMPLER, raw, save)
    else:  # ephemeral: an in-memory snapshot behind a new sampling session
        op = TrainingOp(
            seq_id=seq_id, kind=OpKind.SAVE_WEIGHTS_FOR_SAMPLER, body_hash=_hash(_canonical(raw)), save=save
        )
    return await _submit_save(svc, model_id, op, who, raw)


@router.post("/save_weights")
async def save_weights(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """save_state: adapter weights, Adam moments and step, as tinker://<model_id>/weights/<name>."""
    raw = await json_body(request)
    model_id, seq_id = sequence_key(raw, "save_weights")
    req, problem = parse(SaveWeightsRequest, raw, "save_weights")
    if req is None or metadata_problem(req.user_metadata):
        if not problem:
            assert req is not None  # parse returns no request only with a problem
            problem = metadata_problem(req.user_metadata)
        return await _submit(svc, model_id, _reject(seq_id, raw, problem), who)
    name = req.path if req.path is not None else f"{seq_id:06d}"
    save = SaveRequest(
        path=name, overwrite=req.overwrite, ttl_seconds=req.ttl_seconds, user_metadata=req.user_metadata or {}
    )
    return await _submit_save(svc, model_id, _checked_save(seq_id, OpKind.SAVE_WEIGHTS, raw, save), who, raw)


@router.post("/save_weights_external")
async def save_weights_external(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """PEFT adapter files (adapter_model.safetensors + adapter_config.json) for other serving stacks."""
    raw = await json_body(request)
    model_id, seq_id = sequence_key(raw, "save_weights_external")
    req, problem = parse(SaveWeightsExternalRequest, raw, "save_weights_external")
    if req is None:
        op = _reject(seq_id, raw, problem)
    else:
        save = SaveRequest(path=req.path, overwrite=True, ttl_seconds=req.ttl_seconds)
        try:
            if req.age_encryption_recipients:
                parse_recipients(req.age_encryption_recipients)  # a bad key fails this op's future, naming the field
                save = dataclasses.replace(save, age_recipients=[str(r).strip() for r in req.age_encryption_recipients])
        except CheckpointError as e:
            op = _reject(seq_id, raw, str(e))
        else:
            op = _checked_save(seq_id, OpKind.SAVE_WEIGHTS_EXTERNAL, raw, save)
    return await _submit_save(svc, model_id, op, who, raw)


def _checked_save(seq_id: int, kind: OpKind, raw: dict, save: SaveRequest) -> TrainingOp:
    try:
        check_name(save.path)
        check_ttl(save.ttl_seconds)
    except CheckpointError as e:
        return _reject(seq_id, raw, str(e))
    return TrainingOp(seq_id=seq_id, kind=kind, body_hash=_hash(_canonical(raw)), save=save)


@router.post("/load_weights")
async def load_weights(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """Both modes of load_weights (docs/wire-contract.md §Training routes): create-via-load (session_id +
    model_seq_id) and the legacy in-sequence load."""
    raw = await json_body(request)
    if raw.get("model_id") is not None:
        model_id, seq_id = sequence_key(raw, "load_weights")
        state = await run_of_caller(svc, model_id, who)
        req, problem = parse(LoadWeightsRequest, raw, "load_weights")
        if req is None:
            return await _submit(svc, model_id, _reject(seq_id, raw, problem), who)
        try:
            m = await _loadable(svc, req.path, who)
            if m.base_model != state.start.base_model:
                raise CheckpointError(
                    f"{req.path} was trained on {m.base_model}, this run is on {state.start.base_model}"
                )
            if req.optimizer_config is not None:
                raise CheckpointError(
                    "load_weights: optimizer_config applies only when a training client is created from a "
                    "checkpoint; an existing run keeps the optimizer it was created with"
                )
        except CheckpointError as e:
            return await _submit(svc, model_id, _reject(seq_id, raw, str(e)), who)
        op = TrainingOp(
            seq_id=seq_id,
            kind=OpKind.LOAD_WEIGHTS,
            body_hash=_hash(_canonical(raw)),
            load=LoadCheckpoint(path=req.path, optimizer=bool(req.optimizer)),
        )
        return await _submit(svc, model_id, op, who)
    req = LoadWeightsRequest.model_validate(raw)
    if req.session_id is None or req.model_seq_id is None:
        raise http_error(
            400,
            "load_weights needs model_id (load into a run) or session_id + model_seq_id "
            "(create a run from a checkpoint)",
        )
    _check_model_seq_id(req.model_seq_id)
    check_metadata(req.user_metadata)
    await session_of_caller(svc, req.session_id, who)
    model_id = names.model_id_for(req.session_id, req.model_seq_id)
    try:
        m = await _loadable(svc, req.path, who)
        if req.base_model and req.base_model != m.base_model:
            raise CheckpointError(f"{req.path} was trained on {m.base_model}, not {req.base_model}")
        if await svc.registry.get(m.base_model) is None:
            raise CheckpointError(f"{req.path} needs base model {m.base_model}, which no JAX worker serves")
        lora = _lora_of(m.lora, req.optimizer, req.optimizer_config)
    except CheckpointError as e:
        return {"request_id": _request_id(svc, request_ids.FailedRef(str(e)), who), "model_id": model_id}
    start = RunStart(
        model_id=model_id,
        session_id=req.session_id,
        owner=who,
        base_model=m.base_model,
        lora=lora,
        pool=svc.settings.pool,
        user_metadata=req.user_metadata or {},
        load_path=req.path,
        load_optimizer=req.optimizer,
        snapshot_every=svc.settings.auto_snapshot_every,
        max_live_runs=svc.settings.max_live_runs_per_tenant,
    )
    return await _start_run(svc, start, f"LoRA training run {model_id} from {req.path}")


def _lora_of(saved: dict, with_optimizer: bool, optimizer_config) -> LoraSpec:
    """A run created from a checkpoint: its LoRA config, and its optimizer: the checkpoint's when its state is
    restored (optimizer_config cannot override it), else optimizer_config's (AdamW by default)."""
    chosen, problem = family(optimizer_config)
    if problem:
        raise CheckpointError(problem)
    saved_family = saved.get("optimizer", "adamw")  # checkpoints written before Dimuon are AdamW's
    if with_optimizer and optimizer_config is not None and chosen != saved_family:
        raise CheckpointError(
            f"the checkpoint holds {saved_family} optimizer state; optimizer_config ({chosen}) cannot override "
            "restored optimizer state. Load the weights only to train them with another optimizer"
        )
    return LoraSpec(**{**saved, "optimizer": saved_family if with_optimizer else chosen})


async def _loadable(svc: Services, path: str, who: str):
    """The manifest of a checkpoint a training run may load: the caller's (or public), and a save_state one.

    Sampler and external weights hold no optimizer state and are meant for sampling and other stacks; loading
    them into training used to start fresh Adam moments without a word, so they are refused by name."""
    m = await asyncio.to_thread(svc.checkpoints.readable, path, who)
    kind = m.path.segment
    if kind != "weights":
        raise CheckpointError(
            f"{path} is a {kind} checkpoint (weights for sampling, without optimizer state); "
            "a training run loads save_state checkpoints: tinker://<model_id>/weights/<name>"
        )
    return m
