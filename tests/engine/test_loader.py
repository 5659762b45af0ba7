"""Checkpoint layouts the loader must read: transformers' sharded safetensors (several files plus
model.safetensors.index.json) and a hub id that exists only in the local Hugging Face cache (no network)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.loader import load_model
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig

TOKENS = np.random.default_rng(0).integers(0, 300, size=(2, 20)).astype(np.int32)


def logits(directory: Path) -> np.ndarray:
    loaded = load_model(str(directory), max_adapters=1, max_rank=1, progress=False)
    model = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
    b, t = TOKENS.shape
    routing = LoraRouting(adapter=jnp.zeros((b,), jnp.int32), scale=jnp.zeros((b,), jnp.float32))
    return np.asarray(model(jnp.asarray(TOKENS), jnp.broadcast_to(jnp.arange(t), (b, t)), routing))


def write_sharded(single: Path, out: Path, shards: int = 3) -> Path:
    """`single`'s model.safetensors re-saved as transformers does for large models: model-0000i-of-0000n files
    and model.safetensors.index.json {"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}."""
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True)
    for f in single.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(str(single / "model.safetensors"))
    names = list(tensors)  # file order, so every shard gets a mix of layers and top-level tensors
    weight_map = {}
    for i in range(shards):
        filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    total = int(sum(t.nbytes for t in tensors.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    assert not (out / "model.safetensors").exists()
    return out


def test_sharded_checkpoint_gives_the_single_file_logits(qwen3_dir, tmp_path):
    sharded = write_sharded(qwen3_dir, tmp_path / "sharded")
    assert len(list(sharded.glob("*.safetensors"))) == 3
    ref = logits(qwen3_dir)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_equal(logits(sharded), ref)


def test_sharded_checkpoint_reads_only_the_files_its_index_names(qwen3_dir, tmp_path):
    """A stray safetensors file beside the shards (an adapter, an old consolidated copy) is not read."""
    from safetensors.numpy import save_file

    sharded = write_sharded(qwen3_dir, tmp_path / "sharded", shards=2)
    save_file({"model.norm.weight": np.zeros(64, np.float32)}, str(sharded / "adapter_model.safetensors"))
    np.testing.assert_array_equal(logits(sharded), logits(qwen3_dir))


def test_sharded_checkpoint_missing_a_shard_names_it(qwen3_dir, tmp_path):
    sharded = write_sharded(qwen3_dir, tmp_path / "sharded", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load_model(str(sharded), max_adapters=1, max_rank=1, progress=False)


def hub_cache(source: Path, hub: Path, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    """`source` laid out as huggingface_hub caches a download: blobs/<sha256> holding the bytes,
    snapshots/<revision>/<file> symlinks into blobs, and refs/main naming the revision."""
    org, name = repo_id.split("/")
    repo = hub / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_loads_from_the_local_cache_offline(qwen3_dir, engine, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    # A sharded checkpoint, as the hub serves models of any size, behind the cache's blob symlinks.
    snapshot = hub_cache(write_sharded(qwen3_dir, tmp_path / "sharded"), tmp_path / "hub", "Org/Name")
    # huggingface_hub reads its environment at import: point its constants at the test cache instead.
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)

    hub = Engine.load(
        "Org/Name", max_lora_adapters=engine.max_lora_adapters, max_lora_rank=engine.max_lora_rank, progress=False
    )
    assert Path(hub.model_path) == snapshot
    assert hub.info == engine.info
    request = ForwardBackwardInput(
        slot=0,
        data=[Datum(tokens=TOKENS[0, :-1], inputs={"target_tokens": TOKENS[0, 1:]})],
        loss_fn="cross_entropy",
        forward_only=True,
    )
    results = []
    for e in (hub, engine):
        e.create_adapter(0, LoraConfig(rank=4, seed=0))
        [res] = e.forward_backward([request])
        results.append(res.outputs[0]["logprobs"])  # pyright: ignore[reportAttributeAccessIssue] (an InputError fails the test here)
    np.testing.assert_array_equal(results[0], results[1])


def test_unknown_hub_id_is_refused_without_a_download(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="neither a local directory nor in the local Hugging Face cache"):
        Engine.load("nobody/nothing", progress=False)
