"""Base-model resolution: the embedded default, a local directory, an HF id from the local cache — never a download."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tinkerflow.common.settings import Settings
from tinkerflow.workers.base_model import UnknownModelError, resolve_base_model
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model


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
    name, local = resolve_base_model(
        Settings(state_dir=tmp_path, base_model=str(tiny), served_model_name="Qwen/Qwen3-0.6B")
    )
    assert name == "Qwen/Qwen3-0.6B" and local == str(tiny.resolve())


def _gpt_oss(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]})
    )
    return directory


def test_a_model_no_family_serves_is_refused_in_one_line(tmp_path):
    model = _gpt_oss(tmp_path / "gpt-oss")
    with pytest.raises(UnknownModelError) as e:
        resolve_base_model(Settings(state_dir=tmp_path, base_model=str(model)))
    message = str(e.value)
    assert "\n" not in message and "unsupported architecture 'gpt_oss' (GptOssForCausalLM)" in message
    assert "families served: llama3 (model_type llama), " in message


def test_up_fails_at_start_naming_the_architecture_and_the_families_served(tmp_path):
    """`tinkerflow up --base-model DIR` checks DIR's config.json before it starts any part."""
    model = _gpt_oss(tmp_path / "gpt-oss")
    state = tmp_path / "state"
    out = subprocess.run(
        [sys.executable, "-m", "tinkerflow.cli.main", "up", "--base-model", str(model), "--state-dir", str(state)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinkerflow up: error: "), out.stderr
    assert "'gpt_oss' (GptOssForCausalLM); families served: llama3 (model_type llama), qwen3" in lines[0]
    assert "qwen3_5 (model_type qwen3_5, qwen3_5_text)" in lines[0]  # Qwen3.5 among them, by both its model types
    assert not (state / "logs").exists()  # no part was started
