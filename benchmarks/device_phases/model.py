"""train, long, sample and agree: the phases that share one worker and one model (Qwen3-8B's shape)."""

from __future__ import annotations

import statistics
import time

from benchmarks.device_phases.decode import phase_sample
from benchmarks.device_phases.measure import Budget, emit, profile_top
from benchmarks.device_phases.parity import logprobs
from benchmarks.device_phases.shapes import QWEN3_8B, TINY, datasheet_peak, matmul_params
from benchmarks.device_phases.tenants import phase_tenants
from benchmarks.device_phases.train_levels import compute_dtype_residual, force_remat, remat_levels, utilisation


class ModelPhases:
    """train, long, sample and agree on one engine: Qwen3-8B's shape (tiny with --smoke), random weights, bf16 on
    accelerators, 8 adapter slots of rank 32."""

    def __init__(self, smoke: bool, budget: Budget, quick: bool = False):
        import jax

        from tinkerflow.workers.engine.engine import Engine
        from tinkerflow.workers.engine.types import LoraConfig

        self.smoke, self.budget, self.quick = smoke, budget, quick
        self.cfg = TINY if smoke else QWEN3_8B
        self.vocab = int(self.cfg["vocab_size"])  # pyright: ignore[reportArgumentType]
        t0 = time.perf_counter()
        self.engine = Engine.random(
            self.cfg,
            max_lora_adapters=8,
            max_lora_rank=32,
            seed=0,
            gradient_checkpointing=True,
            snapshot_budget_bytes=4 * 2**30,
            compute_dtype_residual=compute_dtype_residual(),
        )
        jax.block_until_ready(self.engine._base)
        for slot in range(8):
            self.engine.create_adapter(slot, LoraConfig(rank=32, seed=slot))
        emit(
            phase="model",
            figure="model",
            shape="tiny" if smoke else "qwen3-8b",
            dtype=str(self.engine.dtype),
            init_s=round(time.perf_counter() - t0, 1),
            memory_plan=self.engine.memory.as_metrics(),
            device_memory_in_use_gib=self._mem("bytes_in_use"),
        )
        self.kind = jax.devices()[0].device_kind
        self.pack_tokens = self.engine._steps.pack_tokens  # the engine's own packing, as in service

    def forget_programs(self) -> None:
        """Drop compiled programs, so the next call compiles under the environment as it is now."""
        steps, sampler = self.engine._steps, self.engine.sampler
        for cache in (steps.grad_step, steps.forward_step, *sampler.caches()):
            cache.clear()

    def _mem(self, key: str) -> float | None:
        import jax

        dev = jax.devices()[0]
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        return round(stats[key] / 2**30, 2) if stats and key in stats else None

    def _data(self, n: int, rows: int, seed: int):
        return self.data_of([n] * rows, seed)

    def data_of(self, lengths: list[int], seed: int):
        """Random next-token datums of these lengths."""
        import numpy as np

        from tinkerflow.workers.engine.types import Datum

        rng = np.random.default_rng(seed)
        out = []
        for n in lengths:
            toks = rng.integers(1, self.vocab, n + 1).astype(np.int32)
            out.append(Datum(toks[:-1], {"target_tokens": toks[1:]}))
        return out

    def fb_seconds(self, requests, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats + 1):  # the first compiles
            t0 = time.perf_counter()
            results = self.engine.forward_backward(requests)
            bad = [r for r in results if not hasattr(r, "metrics")]
            if bad:
                raise RuntimeError(f"forward_backward refused: {bad[0]}")
            out.append(time.perf_counter() - t0)
        return out

    def train(self) -> None:
        from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput

        n, rows = (64, 8) if self.smoke else (1024, 8)
        self.engine._steps.pack_tokens = n  # one datum per row in both layouts: the comparison is the adapters'
        data = self._data(n, rows, 0)
        short = self._data(n // 8, rows * 8, 1)  # 8 datums of n/8 tokens per adapter: packed 8 to a row
        layouts = {
            "1_adapter": [ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy")],
            "8_adapters": [ForwardBackwardInput(slot=i, data=[d], loss_fn="cross_entropy") for i, d in enumerate(data)],
            "8_adapters_packed": [
                ForwardBackwardInput(slot=i, data=short[8 * i : 8 * i + 8], loss_fn="cross_entropy") for i in range(8)
            ],
        }
        if self.quick:
            layouts = {"8_adapters": layouts["8_adapters"]}
        peak, n_params = datasheet_peak(self.kind), matmul_params(self.cfg)
        tps = {}
        steps = self.engine._steps
        engine_remat = (steps.forced_remat, steps.remat_min_tokens, steps.full_remat_min_tokens)
        for level in remat_levels():
            for name, requests in layouts.items():
                remat = force_remat(self.engine, level, n)
                try:
                    s = self.fb_seconds(requests, 2 if self.smoke else 3)
                except Exception as e:  # noqa: BLE001 - a level that does not fit is a figure too; the next runs
                    emit(phase="train", figure="train_tokens_per_s", layout=name, remat=remat, error=str(e)[:600])
                    continue
                if level == remat_levels()[0]:
                    tps[name] = n * rows / min(s[1:])
                t0 = time.perf_counter()
                for slot in {r.slot for r in requests}:
                    self.engine.optim_step(slot, AdamConfig(learning_rate=1e-5))
                lengths = [len(d.tokens) for r in requests for d in r.data]
                emit(
                    phase="train",
                    figure="train_tokens_per_s",
                    layout=name,
                    rows=rows,
                    tokens_per_row=n,
                    datums=sum(len(r.data) for r in requests),
                    first_s=round(s[0], 2),
                    step_s=round(min(s[1:]), 3),
                    tokens_per_s=round(n * rows / min(s[1:])),
                    optim_s=round(time.perf_counter() - t0, 3),
                    remat=remat,
                    residual="compute dtype" if compute_dtype_residual() else "float32",
                    gradient_checkpointing=remat != "none",
                    **utilisation(self.engine, self.cfg, n_params, lengths, min(s[1:]), peak, remat),
                )
        force_remat(self.engine, remat_levels()[0], n)  # the tenants and the profile below run at the first level
        if "1_adapter" in tps:
            emit(
                phase="train",
                figure="eight_adapters_cost",
                ratio=round(tps["1_adapter"] / tps["8_adapters"], 3),
                target="<= 1.15",
                reads="one program of one shape in both layouts: holds by construction; tenants_ratio measures it",
            )
        self.engine._steps.pack_tokens = self.pack_tokens
        if not self.quick:
            phase_tenants(self, n * rows)
        profile_top(
            "train step, 8 adapters x 1,024 tokens", lambda: self.engine.forward_backward(layouts["8_adapters"])
        )
        steps.forced_remat, steps.remat_min_tokens, steps.full_remat_min_tokens = engine_remat  # the other phases'

    def long(self) -> None:
        import dataclasses

        from tinkerflow.workers.engine.types import ForwardBackwardInput

        plan = self.engine.memory
        self.engine.memory = dataclasses.replace(plan, max_train_tokens=10**9)  # measure past the plan's limit
        self.engine._steps.pack_tokens = 4096
        for n in (1024, 2048, 4096) if self.smoke else (8192, 16384, 32768):
            if self.budget.left() < (5 if self.smoke else 45):
                emit(phase="long", figure="long_forward_backward", tokens=n, skipped="budget")
                continue
            request = [ForwardBackwardInput(slot=0, data=self._data(n, 1, n), loss_fn="cross_entropy")]
            try:
                s = self.fb_seconds(request, 3)
                median = statistics.median(s[1:])
                emit(
                    phase="long",
                    figure="long_forward_backward",
                    tokens=n,
                    first_s=round(s[0], 2),
                    step_s=round(median, 3),
                    step_s_all=[round(x, 3) for x in s[1:]],
                    step_s_is="median of the 3 repetitions after the compiling call",
                    tokens_per_s=round(n / median),
                    peak_gib=self._mem("peak_bytes_in_use"),
                    plan_estimate_gib=round(
                        (plan.resident_bytes + plan.train_fixed_bytes + n * plan.train_bytes_per_token) / 2**30, 2
                    ),
                    plan_max_train_tokens=plan.max_train_tokens,
                )
            except Exception as e:  # noqa: BLE001 - an out-of-memory here is a figure
                emit(
                    phase="long",
                    figure="long_forward_backward",
                    tokens=n,
                    error=f"{type(e).__name__}: {str(e)[:400]}",
                    plan_max_train_tokens=plan.max_train_tokens,
                )
        self.engine.memory = plan

    def sample(self) -> None:
        """Decode ms per step with each layer loop (device_phases/decode.py)."""
        phase_sample(self)

    def _weight_bytes(self) -> tuple[int, int]:
        """Bytes of the base weights and of the embedding table among them."""
        import jax

        leaves = jax.tree_util.tree_leaves_with_path(self.engine._base)
        embedding = sum(x.nbytes for path, x in leaves if "embed_tokens" in jax.tree_util.keystr(path))
        return sum(x.nbytes for _, x in leaves), embedding

    def agree(self) -> None:
        import numpy as np

        from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput, SampleInput, SampleResult

        self.engine.forward_backward([ForwardBackwardInput(slot=0, data=self._data(64, 2, 3), loss_fn="cross_entropy")])
        self.engine.optim_step(0, AdamConfig(learning_rate=1e-3))  # LoRA B no longer zero: the adapter matters
        self.engine.snapshot(0, "agree")
        rng = np.random.default_rng(2)
        prompt = rng.integers(1, self.vocab, 40).astype(np.int32)
        [res] = self.engine.sample(
            [SampleInput(prompt=prompt, max_tokens=24, seed=5, stop_token_ids=[], snapshot="agree")]
        )
        assert isinstance(res, SampleResult), res
        seq = res.sequences[0]
        full = np.concatenate([prompt, np.asarray(seq.tokens, np.int32)])
        trainer = logprobs(self.engine, full)[len(prompt) - 1 :]
        d = np.abs(np.asarray(seq.logprobs) - trainer)
        emit(
            phase="agree",
            figure="sampler_vs_trainer_logprobs",
            max_abs=float(d.max()),
            mean_abs=float(d.mean()),
            tokens=len(seq.tokens),
            dtype=str(self.engine.dtype),
        )
