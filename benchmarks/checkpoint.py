"""Checkpoint cost on the JAX worker's path (activities/checkpoint_io.py): save_state (orbax), PEFT export, load
back into a slot, load a sampler snapshot; one JSON line per figure.

    python -m benchmarks.checkpoint                      # tiny model, local checkpoint root
    python -m benchmarks.checkpoint --rank 32 --root gs://bucket/prefix

What an automatic snapshot (--auto-snapshot-every) costs a run is the `save_state` figure.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import emit, stats, time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model directory (default: the embedded tiny Qwen3)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--root", help="checkpoint root URL (default: a temporary local directory)")
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()

    from tinkerflow.activities import checkpoint_io
    from tinkerflow.common.checkpoints import CheckpointStore, now_rfc3339
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
    from tinkerflow.workers.engine.types import LoraConfig

    scratch = Path(tempfile.mkdtemp(prefix="tinkerflow-bench-ckpt-"))
    model = args.model or str(make_tiny_model(scratch / "tiny"))
    engine = Engine.load(model, max_lora_adapters=2, max_lora_rank=args.rank, progress=False)
    engine.create_adapter(0, LoraConfig(rank=args.rank, seed=0))
    rng = np.random.default_rng(0)
    engine.set_adapter_weights(
        0, {k: rng.normal(0, 0.02, v.shape).astype(np.float32) for k, v in engine.adapter_weights(0).items()}
    )
    store = CheckpointStore(args.root or (scratch / "ckpts").as_uri())
    common = {"model": Path(model).name, "lora_rank": args.rank, "root": store.url.split("://")[0]}

    def manifest(path: str) -> dict:
        return {
            "tinker_path": path,
            "owner": "bench",
            "base_model": model,
            "lora": {},
            "time": now_rfc3339(),
            "step": 0,
            "expires_at": None,
            "user_metadata": {},
        }

    state, peft = "tinker://bench:train:0/weights/s", "tinker://bench:train:0/sampler_weights/s"
    saved = {}

    def save_state():
        saved["state"] = checkpoint_io.save(engine, store, 0, manifest(state), overwrite=True)

    def save_peft():
        saved["peft"] = checkpoint_io.save(engine, store, 0, manifest(peft), overwrite=True)

    for name, fn in (
        ("save_state", save_state),
        ("save_peft", save_peft),
        ("load_state", lambda: checkpoint_io.load(engine, store, 1, state, optimizer=True)),
        ("load_sampler_snapshot", lambda: checkpoint_io.load_snapshot(engine, store, peft)),
    ):
        fn()  # warm-up (first orbax / safetensors use)
        size = saved["peft" if "peft" in name or "sampler" in name else "state"].size_bytes
        emit(figure=f"checkpoint_{name}", **common, size_bytes=size, **stats(time_ms(fn, args.iterations)))


if __name__ == "__main__":
    main()
