"""The tiny Qwen3 checkpoint: deterministic, HF-loadable offline, with logits that are not flat."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest

from tinkerflow.workers.engine.model.families.qwen3 import tiny as tiny_model
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

PIG_PROMPT = "English: banana split\nPig Latin:"
FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3-tiny")


def test_layout(model_dir):
    for name in (*FILES, "tinkerflow_tiny.json"):
        assert (model_dir / name).is_file(), name
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")], "temp dirs left behind"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6} and cfg["rope_theta"] == 1e6
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.norm.weight")
    assert keys == {name for name, _ in tiny_model.parameter_shapes()}
    assert "lm_head.weight" not in keys  # tied
    assert emb.dtype == np.float32 and emb.shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert abs(float(emb.std()) - 0.25) < 0.01
    assert np.all(norm == 1.0)


def test_config_mirrors_transformers(model_dir):
    """Every key transformers 5 writes for a Qwen3Config is in our config.json, with the same value."""
    from transformers import AutoConfig, Qwen3Config

    ours = json.loads((model_dir / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(model_dir)
    assert isinstance(cfg, Qwen3Config)
    theirs = json.loads(cfg.to_json_string())
    for key, value in theirs.items():
        assert key in ours, key
        assert ours[key] == value, key


def test_deterministic(model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "again")
    for name in (*FILES, "tinkerflow_tiny.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name
    seeded = make_tiny_model(tmp_path / "seed1", seed=1)
    assert (seeded / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (seeded / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_rerun_does_not_rewrite(model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert make_tiny_model(model_dir) == model_dir
    assert make_tiny_model(str(model_dir)) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_other_parameters_replace_and_foreign_dirs_are_kept(tmp_path):
    out = make_tiny_model(tmp_path / "m", init_std=0.1)
    marker = json.loads((out / "tinkerflow_tiny.json").read_text())
    assert marker["init_std"] == 0.1
    make_tiny_model(out, init_std=0.25)
    assert json.loads((out / "tinkerflow_tiny.json").read_text())["init_std"] == 0.25
    assert [p.name for p in tmp_path.iterdir()] == ["m"]

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_tiny_model(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "m"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_tiny_model(empty) / "model.safetensors").is_file()


def test_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, fast=True)  # as tinker's get_tokenizer calls it
    cfg = json.loads((model_dir / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == cfg["eos_token_id"] == tok.pad_token_id
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [cfg["vocab_size"] - 2, cfg["vocab_size"] - 1]

    ids = tok.encode(PIG_PROMPT, add_special_tokens=True)
    assert tok.convert_ids_to_tokens(ids) == ["English", ":", "Ġbanana", "Ġsplit", "Ċ", "Pig", "ĠLatin", ":"]
    for prompt in ("Say something:", "Tell me a story:", "Write a word:", "Continue:", "Answer:", "Reply:", "Speak:"):
        assert len(tok.encode(prompt)) <= 5, prompt
    for text in (
        PIG_PROMPT,
        " anana-bay plit-say\n\n",
        "Ünïcödé ✓ 日本語\t tabs  and  spaces\r\n",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("<|endoftext|>", add_special_tokens=False) == [cfg["eos_token_id"]]


def test_loads_and_generates(model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)  # pyright: ignore[reportGeneralTypeIssues] (transformers' stubs)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    assert model.config.rope_parameters["rope_theta"] == 1e6
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok.encode(PIG_PROMPT)])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        assert logits.shape == (model.config.vocab_size,)
        assert torch.isfinite(logits).all()
        assert logits.std().item() > 1.0, "logits are flat"
        out = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 20
    assert len(set(new)) > 1, f"greedy decoding repeats one token: {new}"
