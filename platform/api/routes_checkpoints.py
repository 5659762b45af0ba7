"""Checkpoint routes of the RestClient (docs/wire-contract.md §RestClient routes): list, delete, publish, TTL, weights
info, downloads, copy.

Storage is the source of truth: a checkpoint is its manifest (platform/common/checkpoints.py), so these routes read
and write the checkpoint root directly and tell Temporal only about timers (TTL) and loaded weights (deletion).
A tenant sees its own checkpoints and published ones; only the owner may change or delete one; another tenant's
private checkpoint answers 404 like a missing one.

Checkpoint ids contain a slash (`weights/000020`), so the routes that extend one (`/publish`, `/ttl`,
`/external_weights_urls`) are declared before the bare one: Starlette takes the first route that matches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from temporalio.common import WorkflowIDConflictPolicy
from tinker.types import CopyWeightsRequest

from tinkerflow.api import optimizers, signed_urls
from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import from_error, http_error, is_not_found
from tinkerflow.api.identifiers import check_model_id, checkpoint_path
from tinkerflow.api.lookups import checkpoint_of_caller, json_body, session_of_caller
from tinkerflow.api.services import Services
from tinkerflow.common.checkpoints import (
    CheckpointError,
    CheckpointNotFound,
    Manifest,
    TinkerPath,
    check_ttl,
    expiry_after,
    now_rfc3339,
    scratch_dir,
)
from tinkerflow.workflows.checkpoint_expiry import CheckpointExpiry, ExpiryStart
from tinkerflow.workflows.protocol import names

router = APIRouter(prefix="/api/v1")
CHUNK = 1 << 20


def _path(run: str, checkpoint_id: str) -> TinkerPath:
    return checkpoint_path(run, checkpoint_id)


async def _owned(svc: Services, p: TinkerPath, who: str) -> Manifest:
    m = await checkpoint_of_caller(svc, str(p), who)
    if m.owner != who:  # published checkpoints are readable by all, changeable by their owner only
        raise http_error(403, f"checkpoint {p} is published by another user; only its owner can change it")
    return m


def _page(items: list, limit: int, offset: int) -> tuple[list, dict[str, int]]:
    return items[offset : offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


# --- listing -----------------------------------------------------------------------------------------------------


@router.get("/training_runs/{run}/checkpoints")
async def list_run_checkpoints(run: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    check_model_id(run, "training run id")  # never a glob pattern
    manifests = await asyncio.to_thread(svc.checkpoints.list, run)
    return {"checkpoints": [m.as_checkpoint() for m in manifests if m.readable_by(who)]}


@router.get("/checkpoints")
async def list_user_checkpoints(
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    svc: Services = Depends(services),
    who: str = Depends(owner),
) -> dict:
    manifests = [m for m in await asyncio.to_thread(svc.checkpoints.list) if m.owner == who]
    page, cursor = _page(manifests, limit, offset)
    return {"checkpoints": [m.as_checkpoint() for m in page], "cursor": cursor}


@router.post("/weights_info")
async def weights_info(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    path = (await json_body(request)).get("tinker_path", "")
    m = await checkpoint_of_caller(svc, path, who)
    return {
        "base_model": m.base_model,
        "is_lora": True,
        "lora_rank": m.lora["rank"],
        "train_attn": m.lora["train_attn"],
        "train_mlp": m.lora["train_mlp"],
        "train_unembed": m.lora["train_unembed"],
        "optimizer_config": optimizers.config_of(m.lora.get("optimizer", "adamw")),
    }


# --- changing one (specific suffixes first) -----------------------------------------------------------------------


@router.post("/training_runs/{run}/checkpoints/{checkpoint_id:path}/publish")
async def publish(run: str, checkpoint_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    p = _path(run, checkpoint_id)
    await _owned(svc, p, who)
    await asyncio.to_thread(svc.checkpoints.update, p, public=True)
    await svc.audit("checkpoint_published", who, str(p))
    return {}


@router.delete("/training_runs/{run}/checkpoints/{checkpoint_id:path}/publish")
async def unpublish(run: str, checkpoint_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    p = _path(run, checkpoint_id)
    await _owned(svc, p, who)
    await asyncio.to_thread(svc.checkpoints.update, p, public=False)
    await svc.audit("checkpoint_unpublished", who, str(p))
    return {}


@router.put("/training_runs/{run}/checkpoints/{checkpoint_id:path}/ttl")
async def set_ttl(
    run: str, checkpoint_id: str, request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict:
    p = _path(run, checkpoint_id)
    m = await _owned(svc, p, who)
    ttl = (await json_body(request)).get("ttl_seconds")
    try:
        check_ttl(ttl)
    except CheckpointError as e:
        raise from_error(e) from None
    expires_at = expiry_after(ttl)
    await asyncio.to_thread(svc.checkpoints.update, p, expires_at=expires_at)
    await _set_expiry_timer(svc, str(p), expires_at, m.base_model)
    await svc.audit("checkpoint_ttl_set", who, str(p), ttl_seconds=ttl, expires_at=expires_at)
    return {}


async def _set_expiry_timer(svc: Services, path: str, expires_at: str | None, base_model: str) -> None:
    """The durable timer that deletes the files: started here, or moved (or ended, for None) if it runs already."""
    await svc.client.start_workflow(
        CheckpointExpiry.run,
        ExpiryStart(path, expires_at, base_model, svc.settings.pool),
        id=names.checkpoint_expiry_workflow_id(path),
        task_queue=names.WORKFLOW_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal="set_expiry",
        start_signal_args=[expires_at],
        static_summary=f"expires {path} at {expires_at}",
    )


@router.get("/training_runs/{run}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(
    run: str, checkpoint_id: str, request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict:
    p = _path(run, checkpoint_id)
    m = await checkpoint_of_caller(svc, str(p), who)
    expires = signed_urls.expiry()
    urls = {
        rel: signed_urls.sign(svc.signing_key, str(request.base_url), str(p), rel, expires) for rel in sorted(m.files)
    }
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z")}


@router.delete("/training_runs/{run}/checkpoints/{checkpoint_id:path}")
async def delete(run: str, checkpoint_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    p = _path(run, checkpoint_id)
    m = await _owned(svc, p, who)
    await asyncio.to_thread(svc.checkpoints.delete, p)
    await _forget(svc, m)
    await svc.audit("checkpoint_deleted", who, str(p), size_bytes=m.size_bytes)
    return {}


async def _forget(svc: Services, m: Manifest) -> None:
    """After a delete: end its expiry timer, and unload it from any worker that loaded it for sampling."""
    try:
        await svc.client.get_workflow_handle(names.checkpoint_expiry_workflow_id(m.tinker_path)).signal(
            CheckpointExpiry.set_expiry, None
        )
    except Exception as e:
        if not is_not_found(e):
            raise
    try:
        await svc.client.get_workflow_handle(names.coordinator_workflow_id(m.base_model, svc.settings.pool)).signal(
            "forget_checkpoint", m.tinker_path
        )
    except Exception as e:
        if not is_not_found(e):
            raise


# --- copies and downloads ---------------------------------------------------------------------------------------


@router.post("/copy_weights")
async def copy_weights(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """Copy readable weights to a new run id of the caller's (no training client holds it): the same request
    (X-Idempotency-Key) always names the same copy."""
    raw = await json_body(request)
    req = CopyWeightsRequest.model_validate(raw)
    src = await checkpoint_of_caller(svc, req.source_path, who)
    try:
        check_ttl(req.ttl_seconds)
    except CheckpointError as e:
        raise from_error(e) from None
    token = request.headers.get("x-idempotency-key") or f"{req.source_path}|{who}|{now_rfc3339()}"
    digest = hashlib.sha256(f"{who}|{token}".encode()).hexdigest()[:12]
    if req.session_id is not None and req.model_seq_id is not None:
        # The destination namespace is the caller's only if the session is: another tenant's session (and so its
        # runs' tinker:// paths) answers 404, as everywhere else.
        await session_of_caller(svc, req.session_id, who)
        run = names.model_id_for(req.session_id, req.model_seq_id)
    else:
        run = f"copy-{digest}:train:0"  # the caller's key is in the digest: nobody else can name this run
    p = src.path
    try:
        dest = TinkerPath.of(run, p.segment, p.name)
    except CheckpointError as e:
        raise from_error(e) from None
    existing = await asyncio.to_thread(svc.checkpoints.manifest, dest)
    if existing is not None and existing.owner != who:  # belt and braces: never report or keep a foreign copy
        raise http_error(404, f"training run {run!r} does not exist or is not yours")
    if existing is None:
        expires_at = expiry_after(req.ttl_seconds)
        await asyncio.to_thread(_copy, svc, src, dest, who, expires_at)
        if expires_at is not None:
            await _set_expiry_timer(svc, str(dest), expires_at, src.base_model)
    return {"tinker_path": str(dest)}


def _copy(svc: Services, src: Manifest, dest: TinkerPath, who: str, expires_at: str | None) -> None:
    with scratch_dir() as staging:
        svc.checkpoints.download(src.path, staging)
        manifest = dataclasses.replace(
            src, tinker_path=str(dest), owner=who, public=False, time=now_rfc3339(), expires_at=expires_at
        )
        svc.checkpoints.commit(manifest, staging, overwrite=False)


@router.get("/checkpoint_files/{run}/{segment}/{name}/{relative:path}", include_in_schema=False)
async def download_file(
    run: str, segment: str, name: str, relative: str, expires: int, signature: str, svc: Services = Depends(services)
) -> StreamingResponse:
    """What a signed URL points at. No API key: the signature is the authority (signed_urls)."""
    try:
        p = TinkerPath.of(run, segment, name)
    except CheckpointError as e:
        raise from_error(e) from None
    if not signed_urls.verify(svc.signing_key, str(p), relative, expires, signature):
        raise http_error(403, "this download URL is invalid or has expired; ask external_weights_urls for a new one")
    try:
        sizes = await asyncio.to_thread(svc.checkpoints.files, p)
        f = await asyncio.to_thread(svc.checkpoints.open_file, p, relative)
    except CheckpointNotFound as e:
        raise from_error(e) from None

    def chunks() -> Any:
        with f:
            while data := f.read(CHUNK):
                yield data

    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"Content-Length": str(sizes[relative])}
    )
