"""What benchmarks/device_stack.py serves and the recipe it times: a config-only model directory (a real model's
shape, weights drawn on the device) and the cookbook's math_rl loop run against the stack.

The config-only directory holds Qwen3-8B's config.json and the embedded tiny model's tokenizer files: the weights are
random either way, so any tokenizer whose ids lie inside the vocabulary serves (its 2,048 ids lie inside Qwen3's
151,936; sampled ids past them decode to nothing), and the machine needs no 16 GB checkpoint and no Qwen tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

# What the tiny model's directory holds beside its weights that a config-only directory keeps: its tokenizer, chat
# template and generation config (EOS ids).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def shapes() -> dict[str, dict]:
    """Shapes a config-only directory can take: Qwen3-8B (benchmarks/device_phases/shapes.py), or the tiny model's
    own (CPU smoke runs of the random-weights path)."""
    from benchmarks.device_phases.shapes import QWEN3_8B

    return {"qwen3-8b": QWEN3_8B, "tiny": {}}


def has_weights(model_dir: str) -> bool:
    return any(Path(model_dir).glob("*.safetensors"))


def config_only_model(root: Path, shape: str) -> Path:
    """`root/<shape>`: config.json of the named shape (SHAPES) over the tiny model's config (its tokenizer's ids),
    and the tiny model's tokenizer files; no weights."""
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    tiny = make_tiny_model(root / "tokenizer-source", progress=False)
    config = json.loads((tiny / "config.json").read_text())
    config.update(shapes()[shape])
    layers = config["num_hidden_layers"]
    config.update(layer_types=["full_attention"] * layers, max_window_layers=layers)
    if "rope_theta" in shapes()[shape]:
        config.pop("rope_parameters", None)  # the shape's rope_theta stands
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    return out


def math_rl_step_times(base_url: str, api_key: str, model: str, *, smoke: bool, timeout_s: float) -> dict:
    """The cookbook's math_rl recipe (arithmetic env, role_colon renderer) run as a user runs it, against the stack:
    its per-step wall time as the recipe itself logs it (metrics.jsonl's `time/total`). The first step pays the
    compiles of the shapes it meets first, so it is reported beside the median of the others."""
    from benchmarks.recipe_soak import RECIPES, Shape, recipe_args, run_one

    steps = 3 if smoke else 6
    shape = Shape(group=2, batch=2, tokens=12, pad=0) if smoke else Shape(group=8, batch=8, tokens=128, pad=0)
    module = RECIPES["math_rl"][0]
    env = dict(os.environ, TINKER_BASE_URL=base_url, TINKER_API_KEY=api_key, TINKER_TELEMETRY="0")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="device-stack-rl-") as d:
        log_path = Path(d) / "math_rl"
        args = [*recipe_args("math_rl", shape, model, steps, Path(d)), f"log_path={log_path}"]
        status = run_one(module, args, Path(d) / "math_rl.log", env, timeout_s)
        rows = []
        metrics = log_path / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        tail = (Path(d) / "math_rl.log").read_text(errors="replace").splitlines()[-15:] if status != 0 else []
    times = [
        r["time/total"] for r in rows if isinstance(r.get("step"), int) and r["step"] < steps and "time/total" in r
    ]
    return {
        "status": status,
        "steps": len(times),
        "first_step_s": round(times[0], 3) if times else None,
        "warm_step_s": round(statistics.median(times[1:]), 3) if len(times) > 1 else None,
        "step_s": [round(t, 3) for t in times],
        "rollouts_per_step": shape.group * shape.batch,
        "max_tokens": shape.tokens,
        "output_tail": tail,
    }
