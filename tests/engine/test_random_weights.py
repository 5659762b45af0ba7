"""A config-only model directory served with random weights (`--random-weights`): the engine draws the weights of
config.json's shape on the device, as `Engine.random` does, and reads the tokenizer where the directory has one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig, SampleInput


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", progress=False)


def config_only(tiny_dir: Path, dest: Path, *, tokenizer: bool) -> Path:
    dest.mkdir()
    shutil.copy(tiny_dir / "config.json", dest / "config.json")
    if tokenizer:
        for f in tiny_dir.glob("*.json"):
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, dest / f.name)
    return dest


def test_a_config_only_directory_without_the_flag_says_how_to_serve_it(tiny_dir, tmp_path):
    path = config_only(tiny_dir, tmp_path / "m", tokenizer=True)
    with pytest.raises(FileNotFoundError, match="--random-weights"):
        Engine.load(str(path), progress=False)


def test_random_weights_are_the_random_engines_draw_and_the_engine_trains_and_samples(tiny_dir, tmp_path):
    path = config_only(tiny_dir, tmp_path / "m", tokenizer=False)
    engine = Engine.load(str(path), progress=False, random_weights=True, max_lora_adapters=2, max_lora_rank=4)
    assert engine.tokenizer is None  # none in the directory: token ids only
    hf_config = json.loads((path / "config.json").read_text())
    assert engine.info.eos_token_ids == (hf_config["eos_token_id"],)
    reference = Engine.random(hf_config, max_lora_adapters=2, max_lora_rank=4)
    ours = jax.tree.leaves(nnx.to_pure_dict(engine.base))
    theirs = jax.tree.leaves(nnx.to_pure_dict(reference.base))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same seed, same draw: bit for bit

    engine.create_adapter(0, LoraConfig(rank=4))
    tokens = np.arange(1, 18, dtype=np.int32)
    datum = Datum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    out = engine.forward_backward([ForwardBackwardInput(0, [datum], "cross_entropy")])
    assert not isinstance(out[0], Exception)
    assert np.isfinite(np.asarray(out[0].outputs[0]["logprobs"])).all()
    engine.snapshot(0, "s")
    prompt = np.arange(1, 9, dtype=np.int32)
    res = engine.sample([SampleInput(prompt=prompt, max_tokens=4, seed=0, stop_token_ids=[], snapshot="s")])[0]
    assert not isinstance(res, Exception)
    assert len(res.sequences[0].tokens) == 4


def test_random_weights_read_the_tokenizer_where_the_directory_has_one(tiny_dir, tmp_path):
    path = config_only(tiny_dir, tmp_path / "m", tokenizer=True)
    engine = Engine.load(str(path), progress=False, random_weights=True, max_lora_adapters=1, max_lora_rank=4)
    assert engine.tokenizer is not None
    assert engine.tokenizer.decode(engine.tokenizer.encode("a cat")) == "a cat"


def test_the_setting_reaches_the_worker_from_the_environment(monkeypatch):
    from tinkerflow.common.settings import Settings

    assert Settings().random_weights is False
    monkeypatch.setenv("TINKERFLOW_RANDOM_WEIGHTS", "1")
    assert Settings().random_weights is True
