"""Base-model resolution: the embedded default, a local directory, an HF id from the local cache — never a download."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tinkerflow.common.settings import Settings
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
from tinkerflow.workers.models import UnknownModelError, resolve_base_model


def _use_hub_cache(monkeypatch, path: Path) -> None:
    # huggingface_hub reads its environment once, at import: point its constants at the test cache instead.
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(path))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_default_is_the_embedded_tiny_model(tmp_path):
    name, local = resolve_base_model(Settings(state_dir=tmp_path))
    assert Path(local) == (tmp_path / "models" / "tiny-qwen3").resolve()
    assert name == local and (Path(local) / "config.json").exists()


def test_local_directory_is_served_under_its_absolute_path(tiny, tmp_path):
    name, local = resolve_base_model(Settings(state_dir=tmp_path, base_model=str(tiny)))
    assert name == local == str(tiny.resolve())


def test_hf_id_resolves_from_the_local_cache_offline(tiny, tmp_path, monkeypatch):
    # The hub cache layout: models--<org>--<name>/snapshots/<revision>/ and refs/main naming the revision.
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-Tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    _use_hub_cache(monkeypatch, tmp_path / "hub")
    name, local = resolve_base_model(Settings(state_dir=tmp_path, base_model="Qwen/Qwen3-Tiny"))
    assert name == "Qwen/Qwen3-Tiny" and Path(local) == snapshot


def test_unknown_id_says_what_to_do(tmp_path, monkeypatch):
    _use_hub_cache(monkeypatch, tmp_path / "empty-hub")
    with pytest.raises(UnknownModelError, match="neither a local directory nor in the local Hugging Face cache"):
        resolve_base_model(Settings(state_dir=tmp_path, base_model="nobody/nothing"))


def test_served_model_name_names_a_local_copy_by_its_hf_id(tiny, tmp_path):
    # vLLM's --served-model-name: clients send and see the HF id; the worker loads the local directory.
    name, local = resolve_base_model(Settings(state_dir=tmp_path, base_model=str(tiny),
                                              served_model_name="Qwen/Qwen3-0.6B"))  # fmt: skip
    assert name == "Qwen/Qwen3-0.6B" and local == str(tiny.resolve())
