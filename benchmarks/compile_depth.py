"""Train-step compile time against depth: the engine's forward+backward step lowered and compiled for a model shape at
several layer counts, with the decoder layers stacked and scanned (the default) and as a per-layer loop. Abstract
shapes only (no weights are made, nothing runs), so it needs little memory. One JSON line per (layers, depth):
lower_s, compile_s and the lowered program's StableHLO op count.

    python -m benchmarks.compile_depth [--shape qwen3-0.6b] [--depths 2,8,28] [--batch 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import os
import re
import time
from functools import partial
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
from flax import nnx

from benchmarks.common import emit
from benchmarks.train import RANK, SHAPES


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def measure(shape: dict, depth: int, *, scan: bool, batch: int, seq: int) -> dict:
    from transformers import Qwen3Config

    from tinkerflow.workers.engine.model.decoder import build_causal_lm
    from tinkerflow.workers.engine.model.dtypes import default_dtype
    from tinkerflow.workers.engine.model.families import ModelConfig
    from tinkerflow.workers.engine.model.sharding import DeviceLayout, MeshConfig, as_mesh
    from tinkerflow.workers.engine.training.steps import StepFunctions, pack

    config = ModelConfig.from_hf(Qwen3Config(**{**shape, "num_hidden_layers": depth}).to_dict())
    model = nnx.eval_shape(
        lambda: build_causal_lm(
            config, max_adapters=4, max_rank=RANK, rngs=nnx.Rngs(0), param_dtype=default_dtype(), scan_layers=scan
        )
    )
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, nnx.Param)
    steps = StepFunctions(graphdef, DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), config))

    b, t = batch, seq
    data = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pack([], [], b, t, 1))
    # The engine's own step function (steps.StepFunctions), jitted as its AotCache jits it (accumulator donated).
    t0 = time.perf_counter()
    step = jax.jit(partial(steps.grad_step._fn, remat=False), donate_argnums=2)
    lowered = step.lower(_abstract(lora), _abstract(base), _abstract(lora), data)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    ops = len(re.findall(r"= (?:stablehlo|chlo)\.\w+", lowered.as_text()))
    return dict(lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2), hlo_ops=ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shape", choices=[s for s in SHAPES if s.startswith("qwen3-") and "a3b" not in s], default="qwen3-0.6b"
    )
    parser.add_argument("--depths", default="2,8,28", help="comma-separated layer counts")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    for scan in (True, False):
        for depth in (int(d) for d in args.depths.split(",")):
            figures = measure(SHAPES[args.shape], depth, scan=scan, batch=args.batch, seq=args.seq)
            emit(
                figure="train_step_compile_by_depth",
                shape=args.shape,
                layers="scan" if scan else "loop",
                depth=depth,
                rows=args.batch,
                seq=args.seq,
                lora_rank=RANK,
                **figures,
            )


if __name__ == "__main__":
    main()
