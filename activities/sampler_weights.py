"""Where a JAX worker's sampler weights come from, and how they outlive the worker.

Three kinds of sampler, by the key a sample item names (docs/architecture.md §Sampler weights across a restart):

- `""`: the base model, always here.
- `tinker://<run>/sampler_weights/<name>`: named weights, PEFT files in the checkpoint store; loaded on first use
  and again whenever this worker lost them (evicted, or a successor process).
- anything else: an ephemeral snapshot (`save_weights_and_get_sampling_client`, an inflight key). The snapshot is
  taken from the run's slot into the engine's memory for the samplers that follow at once, and its weights are also
  written to the claim-check store (`sampler-weights/<key>`), so that a worker that dies, or a snapshot collected
  from memory after sitting unused, does not break the client holding it: the next sample that names the key loads
  it back from there, on whichever worker the Coordinator sends it to. The store's retention sweep collects those
  copies (`--store-retention-s`), like every other per-request object.

The copy is written inside the snapshot op, before it answers: a sampling client the SDK holds can always be served
by a successor. It costs one device-to-host read of the adapter and one file of its size (rank × (in + out) per
module, float32), small beside the step that produced it.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import asdict
from typing import Any
from urllib.parse import quote

import numpy as np

from tinkerflow.activities import checkpoint_io
from tinkerflow.common.checkpoints import CheckpointError, CheckpointStore
from tinkerflow.common.errors import StoreError
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workers.engine.interface import EngineApi
from tinkerflow.workers.engine.types import InputError, LoraConfig

log = logging.getLogger(__name__)
# The claim-check store's folder of ephemeral snapshots' weights (swept on the store's retention).
KIND = "sampler-weights"
_CONFIG = "__lora_config__"


def is_named(key: str) -> bool:
    return key.startswith("tinker://")


def object_name(key: str) -> str:
    """The store object of an ephemeral key: the key itself, quoted so that any key is one flat file name."""
    return quote(key, safe="")


def encode(config: LoraConfig, weights: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    arrays: dict[str, Any] = {_CONFIG: np.array(json.dumps(asdict(config))), **weights}  # Any: savez's **kwds
    np.savez(buf, **arrays)
    return buf.getvalue()


def decode(data: bytes) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        config = LoraConfig(**json.loads(str(z[_CONFIG])))
        return config, {k: z[k] for k in z.files if k != _CONFIG}


class SamplerWeights:
    """The worker's sampler weights by key: taken, loaded, reloaded when lost, dropped."""

    def __init__(self, engine: EngineApi, store: ClaimCheckStore, checkpoints: CheckpointStore | None):
        self.engine = engine
        self.store = store
        self.checkpoints = checkpoints
        self.load_errors: dict[str, str] = {}  # keys a sample batch asked for whose load failed, and why

    def take(self, slot: int, key: str) -> None:
        """Snapshot the slot as `key`; an ephemeral key's weights are also written where a successor finds them."""
        self.engine.snapshot(slot, key)
        if not key or is_named(key):
            return  # named weights were committed as PEFT files by the save before this snapshot
        state = self.engine.export_slot(slot)
        self.store.put_named(KIND, object_name(key), encode(state.config, state.weights))
        self.load_errors.pop(key, None)

    def load(self, key: str) -> None:
        """Load `key` into the engine from where it is kept: named weights from the checkpoint store, an ephemeral
        snapshot from its copy in the claim-check store. A failure is remembered for the samples that name it."""
        try:
            if is_named(key):
                if self.checkpoints is None:
                    raise CheckpointError("this JAX worker has no checkpoint storage configured (--checkpoint-root)")
                checkpoint_io.load_snapshot(self.engine, self.checkpoints, key)
            else:
                try:
                    data = self.store.get_named(KIND, object_name(key))
                except StoreError as e:
                    raise InputError(
                        f"sampler weights {key!r} were lost with the JAX worker that held them and have no copy in "
                        f"the store ({e}; copies older than --store-retention-s are collected); save new sampler "
                        "weights"
                    ) from e
                config, weights = decode(data)
                self.engine.load_snapshot(key, config, weights)
                log.info("sampler weights %s loaded from their copy in the claim-check store", key)
            self.load_errors.pop(key, None)
        except (InputError, CheckpointError) as e:
            self.load_errors[key] = str(e)
            raise

    def ready(self, key: str) -> None:
        """Before a sample names `key`: raise the load error it met, or reload weights the snapshot budget pushed
        out of this worker (named and ephemeral alike: both have a copy to read)."""
        if key in self.load_errors:
            raise InputError(f"could not load sampler weights {key}: {self.load_errors[key]}")
        if key and self.engine.snapshot_evicted(key):
            try:
                self.load(key)
            except (InputError, CheckpointError) as e:
                raise InputError(f"could not reload sampler weights {key}: {e}") from e

    def drop(self, keys: list[str], session_prefix: str = "") -> None:
        """Let go of the weights in memory. A session's end (`session_prefix`) also deletes its ephemeral copies: no
        client of it can sample any more. A collection of unused snapshots keeps them (a client may still hold one);
        the store's retention sweep takes what is left."""
        for key in keys:
            self.engine.drop_snapshot(key)
        if session_prefix:
            gone = self.store.delete_named(KIND, object_name(session_prefix))
            log.debug("deleted %d ephemeral sampler copies of %s", gone, session_prefix)
