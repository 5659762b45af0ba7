"""Checkpoints between the engine and storage: which format each kind uses, staged locally, committed atomically.

    tinker://<run>/weights/<name>           save_state: orbax training state (weights, Adam moments, step)
    tinker://<run>/sampler_weights/<name>   save_weights_for_sampler(name): PEFT adapter files
    tinker://<run>/external_weights/<name>  save_weights_external: PEFT adapter files, for other serving stacks

Every payload is written to a local staging directory first and then committed by `CheckpointStore.commit`
(payload, then manifest), so a JAX worker killed mid-save leaves nothing that lists or loads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from tinkerflow.common.age_export import encrypt_tree
from tinkerflow.common.checkpoints import (
    TRAINING_STATE_SEGMENTS,
    CheckpointError,
    CheckpointStore,
    Manifest,
    TinkerPath,
    now_rfc3339,
    scratch_dir,
)
from tinkerflow.common.settings import env_setting
from tinkerflow.workers.engine.interface import EngineApi
from tinkerflow.workers.engine.model import checkpoint as formats
from tinkerflow.workers.engine.types import LoraConfig, SlotState

log = logging.getLogger(__name__)


def save(
    engine: EngineApi,
    store: CheckpointStore,
    slot: int,
    manifest: dict[str, Any],
    *,
    overwrite: bool,
    age_recipients: list[str] | None = None,
) -> Manifest:
    """Write one checkpoint; with `age_recipients` (external weights only) every file is stored as `<name>.age`."""
    started = time.perf_counter()
    state: SlotState = engine.export_slot(slot)
    fields: dict[str, Any] = {**manifest, "time": now_rfc3339(), "lora": _lora_dict(state.config)}
    m = Manifest(**fields)
    p = m.path
    with scratch_dir() as staging:
        if p.segment in TRAINING_STATE_SEGMENTS:
            formats.write_training_state(state, staging, base_model_name_or_path=m.base_model)
            m = replace(m, has_optimizer=True, format="orbax+peft-config")
        else:
            formats.write_peft(state.config, state.weights, staging, base_model_name_or_path=m.base_model)
            m = replace(m, format="peft")
            if age_recipients:
                encrypt_tree(staging, age_recipients)
                m = replace(m, format="peft+age")
        committed = store.commit(
            m, staging, overwrite=overwrite, pause_before_manifest_s=env_setting("fault_pause_before_commit_s")
        )
    log.info("saved %s (%d bytes) in %.2fs", p, committed.size_bytes, time.perf_counter() - started)
    return committed


def read_state(store: CheckpointStore, path: str) -> tuple[Manifest, SlotState]:
    """The checkpoint's training state; PEFT kinds come back with zero moments (and has_optimizer False)."""
    p = TinkerPath.parse(path)
    with scratch_dir() as staging:
        m = store.download(p, staging)
        if m.format.endswith("+age"):
            raise CheckpointError(
                f"{path} is age-encrypted to its owner's keys; the service cannot load it. "
                "Save it again without age_encryption_recipients to sample or train from it"
            )
        if p.segment in TRAINING_STATE_SEGMENTS:
            return m, formats.read_training_state(staging)
        config, weights = formats.read_peft(staging)
    zeros = {k: v * 0 for k, v in weights.items()}
    return m, SlotState(config=config, weights=weights, mu=zeros, nu=dict(zeros), step=0)


def load(engine: EngineApi, store: CheckpointStore, slot: int, path: str, *, optimizer: bool) -> dict[str, Any]:
    m, state = read_state(store, path)
    if optimizer and not m.has_optimizer:
        raise CheckpointError(
            f"{path} holds weights only (no optimizer state); load it without the optimizer, or "
            "load a save_state checkpoint (tinker://…/weights/…)"
        )
    # The slot's config as loaded: the checkpoint's LoRA config, the run's own optimizer family.
    config = engine.import_slot(slot, state, optimizer=optimizer)
    log.info("loaded %s into slot %d (optimizer %s)", path, slot, optimizer)
    return {"lora": _lora_dict(config), "step": state.step if optimizer else 0, "path": path}


def load_snapshot(engine: EngineApi, store: CheckpointStore, path: str) -> None:
    _, state = read_state(store, path)
    engine.load_snapshot(path, state.config, state.weights)


def _lora_dict(config: LoraConfig) -> dict[str, Any]:
    return {
        "rank": config.rank,
        "seed": config.seed,
        "train_attn": config.train_attn,
        "train_mlp": config.train_mlp,
        "train_unembed": config.train_unembed,
        "optimizer": config.optimizer,
    }
