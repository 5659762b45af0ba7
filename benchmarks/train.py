"""Training throughput: forward_backward tokens/s and optim_step ms of the JAX engine, against a bare jitted JAX
step doing the same math. Prints one JSON line per figure.

    python -m benchmarks.train [--shape tiny|qwen3-0.6b|qwen3-8b|qwen3-30b-a3b-1l] [--steps N] [--with-sdk]
                               [--layers scan|loop]

Shapes: `tiny` is the embedded tiny Qwen3 (make_tiny_model); `qwen3-0.6b` and `qwen3-8b` are random-weight
checkpoints with Qwen3-0.6B's / Qwen3-8B's exact shapes, written in the Hugging Face layout to a temporary directory
(float32 on CPU, bfloat16 on accelerators, as the engine stores them); `qwen3-30b-a3b-1l` is the MoE shape of
benchmarks/moe_shape.py (Qwen3-30B-A3B's layer, 128 experts top-8, 1 layer). Without --shape: tiny and
qwen3-0.6b, plus qwen3-8b on a GPU. The batch is 4 rows x 128 tokens of random ids, one LoRA adapter of rank 32 on every
module.

The bare baseline is the same model forward (the engine's NNX modules and LoRA) + cross-entropy + gradient w.r.t.
the LoRA parameters under one jax.jit, fed device-resident arrays: no validation, no bucketing, no accumulator, no
host transfer of logprobs. `engine_vs_bare_ratio` = engine tokens/s / bare tokens/s. Compile times are reported
in their own figure, never inside timed steps. MFU (GPU/TPU only) uses the usual 6 * N * tokens / s convention with
N the base model's matmul parameters (LoRA's own FLOPs and attention's T^2 term left out), over the chip's dense
bf16 peak.

With --with-sdk each shape is also measured through the Tinker SDK against `tinkerflow up` serving that checkpoint
(HTTP -> Temporal -> JAX worker), after the in-process engine is released; `sdk_vs_engine` then sets the SDK's
forward_backward tokens/s and optim_step ms beside the engine-alone ones (ratio and per-step overhead).

--layers loop runs the engine (and the bare step, which uses the engine's model) with the per-layer loop instead
of the default stacked, scanned layers (decoder.DecoderStack), to set the two side by side; every figure carries
`layers`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit, stats
from benchmarks.device_phases.shapes import QWEN3_8B_SHAPE, datasheet_peak
from benchmarks.moe_shape import QWEN3_30B_A3B_1L, matmul_params, write_random_checkpoint

RANK = 32
ROWS, SEQ = 4, 128

SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": QWEN3_8B_SHAPE,
    "qwen3-30b-a3b-1l": QWEN3_30B_A3B_1L,
}


def batch(vocab: int, rows: int = ROWS, seq: int = SEQ, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, seq + 1).astype(np.int32) for _ in range(rows)]


def engine_figures(
    model_dir: Path, label: str, seqs: list[np.ndarray], steps: int, mfu_params: int | None, layers: str = "scan"
) -> dict:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig

    t0 = time.perf_counter()
    engine = Engine.load(
        str(model_dir), max_lora_adapters=4, max_lora_rank=RANK, progress=False, scan_layers=layers == "scan"
    )
    load_s = time.perf_counter() - t0
    engine.create_adapter(0, LoraConfig(rank=RANK, seed=0))
    data = [Datum(tokens=s[:-1], inputs={"target_tokens": s[1:]}) for s in seqs]
    request = ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy")
    tokens = sum(len(d.tokens) for d in data)
    common = dict(
        shape=label, rows=len(seqs), seq=len(data[0].tokens), lora_rank=RANK, dtype=str(engine.dtype), layers=layers
    )

    def fb():
        [res] = engine.forward_backward([request])  # noqa: F821 - fb is not called after `del engine` below
        return res

    adam = AdamConfig(learning_rate=1e-4)
    t0 = time.perf_counter()
    fb()  # compiles the step for this bucket
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.optim_step(0, adam)
    first_opt_s = time.perf_counter() - t0
    compile_s = sum(engine._steps.grad_step.compile_seconds.values())
    emit(
        figure="compile_s",
        path="engine",
        **common,
        train_step_compile_s=round(compile_s, 2),
        first_forward_backward_s=round(first_s, 2),
        first_optim_step_s=round(first_opt_s, 2),
        load_s=round(load_s, 2),
    )

    fb_ms, opt_ms = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fb()
        fb_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        engine.optim_step(0, adam)
        opt_ms.append((time.perf_counter() - t0) * 1000)
    engine_tps = tokens / (float(np.median(fb_ms)) / 1000)

    bare_ms, bare_compile_s = bare_step_ms(engine, seqs, steps)
    bare_tps = tokens / (float(np.median(bare_ms)) / 1000)
    extra = {}
    if mfu_params is not None:
        extra = mfu(mfu_params, engine_tps)
    emit(
        figure="forward_backward_tokens_per_s",
        path="engine",
        **common,
        tokens_per_s=round(engine_tps, 1),
        **stats(fb_ms),
        **extra,
    )
    emit(
        figure="forward_backward_tokens_per_s",
        path="bare_jax",
        **common,
        tokens_per_s=round(bare_tps, 1),
        **stats(bare_ms),
        compile_s=round(bare_compile_s, 2),
        **(mfu(mfu_params, bare_tps) if mfu_params else {}),
    )
    emit(figure="engine_vs_bare_ratio", **common, ratio=round(engine_tps / bare_tps, 3))
    emit(figure="optim_step_ms", path="engine", **common, **stats(opt_ms))
    del engine
    gc.collect()
    return {"tokens_per_s": engine_tps, "optim_step_ms": float(np.median(opt_ms))}


def bare_step_ms(engine, seqs: list[np.ndarray], steps: int) -> tuple[list[float], float]:
    """The same forward + LoRA + cross-entropy + LoRA gradient as one jitted function on device-resident inputs."""
    from flax import nnx

    from tinkerflow.workers.engine.model.lora import LoraRouting

    graphdef, base, lora = engine._graphdef, engine._base, engine.adapters.lora
    tokens = jnp.asarray(np.stack([s[:-1] for s in seqs]))
    targets = jnp.asarray(np.stack([s[1:] for s in seqs]))
    b, t = tokens.shape
    routing = LoraRouting(adapter=jnp.zeros((b,), jnp.int32), scale=jnp.full((b,), 1.0, jnp.float32))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit
    def step(lora, base, tokens, targets):
        def loss(lora):
            model = nnx.merge(graphdef, lora, base)
            logp = jax.nn.log_softmax(model(tokens, positions, routing), axis=-1)
            return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))

        return jax.value_and_grad(loss)(lora)

    t0 = time.perf_counter()
    compiled = step.lower(lora, base, tokens, targets).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(lora, base, tokens, targets))  # warm-up
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(lora, base, tokens, targets))
        out.append((time.perf_counter() - t0) * 1000)
    return out, compile_s


def mfu(params: int, tokens_per_s: float) -> dict:
    kind = jax.devices()[0].device_kind
    peak = datasheet_peak(kind)
    flops = 6 * params * tokens_per_s
    return {
        "model_tflops_per_s": round(flops / 1e12, 2),
        "mfu": round(flops / peak, 4) if peak else None,
        "flops_convention": "6 * N_base_matmul_params * tokens/s (forward+backward through the frozen base; "
        "LoRA and attention T^2 FLOPs excluded)",
        "peak_flops": peak,
    }


def sdk_figures(model_dir: Path, label: str, seqs: list[np.ndarray], steps: int, engine: dict) -> None:
    """The same batch and step through the SDK; `engine` (from engine_figures) gives the in-process figures to
    set the SDK's beside."""
    import tinker
    from tinker import types

    from tinkerflow.cli.launch import launch

    api_key = "tml-bench-key"
    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-") as d:
        stack = launch(Path(d) / "state", api_key=api_key, extra=["--base-model", str(model_dir)])
        try:
            service = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
            base_model = stack.served_model()
            training = service.create_lora_training_client(base_model=base_model, rank=RANK).result()
            data = [
                types.Datum(
                    model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                    loss_fn_inputs=dict(target_tokens=s[1:].tolist()),
                )
                for s in seqs
            ]
            adam = types.AdamParams(learning_rate=1e-4)
            tokens = sum(len(s) - 1 for s in seqs)
            t0 = time.perf_counter()
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(adam).result()
            first_s = time.perf_counter() - t0
            fb_ms, opt_ms = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                training.forward_backward(data, "cross_entropy").result()
                fb_ms.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                training.optim_step(adam).result()
                opt_ms.append((time.perf_counter() - t0) * 1000)
        finally:
            stack.stop()
    common = dict(shape=label, rows=len(seqs), seq=len(seqs[0]) - 1, lora_rank=RANK)
    emit(figure="compile_s", path="sdk", **common, first_forward_backward_and_optim_s=round(first_s, 2))
    emit(
        figure="forward_backward_tokens_per_s",
        path="sdk",
        **common,
        tokens_per_s=round(tokens / (float(np.median(fb_ms)) / 1000), 1),
        **stats(fb_ms),
    )
    emit(figure="optim_step_ms", path="sdk", **common, **stats(opt_ms))
    sdk_tps, sdk_opt = tokens / (float(np.median(fb_ms)) / 1000), float(np.median(opt_ms))
    emit(
        figure="sdk_vs_engine",
        **common,
        engine_tokens_per_s=round(engine["tokens_per_s"], 1),
        sdk_tokens_per_s=round(sdk_tps, 1),
        tokens_per_s_ratio=round(sdk_tps / engine["tokens_per_s"], 3),
        engine_optim_step_ms=round(engine["optim_step_ms"], 3),
        sdk_optim_step_ms=round(sdk_opt, 3),
        optim_step_overhead_ms=round(sdk_opt - engine["optim_step_ms"], 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shape",
        choices=["tiny", *SHAPES],
        action="append",
        help="repeatable; default: tiny and qwen3-0.6b (+ qwen3-8b on GPU)",
    )
    parser.add_argument("--steps", type=int, help="timed steps after one warm-up (default 20 tiny, 3 larger)")
    parser.add_argument("--with-sdk", action="store_true", help="also measure through the SDK against tinkerflow up")
    parser.add_argument(
        "--layers",
        choices=["scan", "loop"],
        default="scan",
        help="decoder layers stacked and scanned (default) or a per-layer loop, for comparison",
    )
    parser.add_argument("--workdir", help="where to write checkpoints (default: a temporary directory)")
    args = parser.parse_args()

    accelerator = jax.default_backend() != "cpu"
    shapes = args.shape or (["tiny", "qwen3-0.6b"] + (["qwen3-8b"] if jax.default_backend() == "gpu" else []))
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="tinkerflow-train-bench-", dir=args.workdir) as work:
        work = Path(work)
        tiny = make_tiny_model(work / "tiny")
        for label in shapes:
            if label == "tiny":
                model_dir, params = tiny, None
                vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
                steps = args.steps or 20
            else:
                t0 = time.perf_counter()
                model_dir = write_random_checkpoint(
                    work / label, SHAPES[label], "bfloat16" if accelerator else "float32", tiny
                )
                emit(figure="checkpoint_write_s", shape=label, seconds=round(time.perf_counter() - t0, 1))
                params, vocab = matmul_params(SHAPES[label]), SHAPES[label]["vocab_size"]
                steps = args.steps or 3
            seqs = batch(vocab)
            engine = engine_figures(model_dir, label, seqs, steps, params if accelerator else None, args.layers)
            if args.with_sdk:
                sdk_figures(model_dir, label, seqs, steps, engine)
            if label != "tiny":
                shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
