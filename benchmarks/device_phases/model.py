"""train, long, sample and agree: the phases that share one worker and one model (Qwen3-8B's shape)."""

from __future__ import annotations

import time

from benchmarks.device_phases.measure import Budget, emit, profile_top
from benchmarks.device_phases.parity import logprobs
from benchmarks.device_phases.shapes import QWEN3_8B, TINY, datasheet_peak, matmul_params


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
        import numpy as np

        from tinkerflow.workers.engine.types import Datum

        rng = np.random.default_rng(seed)
        out = []
        for _ in range(rows):
            toks = rng.integers(1, self.vocab, n + 1).astype(np.int32)
            out.append(Datum(toks[:-1], {"target_tokens": toks[1:]}))
        return out

    def _fb_seconds(self, requests, repeats: int) -> list[float]:
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
        peak, flops_per_token = datasheet_peak(self.kind), 6 * matmul_params(self.cfg)
        tps = {}
        for name, requests in layouts.items():
            s = self._fb_seconds(requests, 2 if self.smoke else 3)
            tps[name] = n * rows / min(s[1:])
            t0 = time.perf_counter()
            for slot in {r.slot for r in requests}:
                self.engine.optim_step(slot, AdamConfig(learning_rate=1e-5))
            emit(
                phase="train",
                figure="train_tokens_per_s",
                layout=name,
                rows=rows,
                tokens_per_row=n,
                datums=sum(len(r.data) for r in requests),
                first_s=round(s[0], 2),
                step_s=round(min(s[1:]), 3),
                tokens_per_s=round(tps[name]),
                mfu_datasheet=round(flops_per_token * tps[name] / peak, 3) if peak else None,
                optim_s=round(time.perf_counter() - t0, 3),
                gradient_checkpointing=True,
                flops_convention="6 * N_base_matmul_params per token",
            )
        if "1_adapter" in tps:
            emit(
                phase="train",
                figure="eight_adapters_cost",
                ratio=round(tps["1_adapter"] / tps["8_adapters"], 3),
                target="<= 1.15",
            )
        profile_top(
            "train step, 8 adapters x 1,024 tokens", lambda: self.engine.forward_backward(layouts["8_adapters"])
        )

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
                s = self._fb_seconds(request, 1)
                emit(
                    phase="long",
                    figure="long_forward_backward",
                    tokens=n,
                    first_s=round(s[0], 2),
                    step_s=round(s[-1], 3),
                    tokens_per_s=round(n / s[-1]),
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
        import numpy as np

        from tinkerflow.workers.engine.types import SampleInput

        for slot in range(8):
            self.engine.snapshot(slot, f"s{slot}")
        prompt_len = 64
        rng = np.random.default_rng(1)
        prompt = rng.integers(1, self.vocab, prompt_len).astype(np.int32)
        kv_token = self.engine.memory.kv_bytes_per_token
        weights = sum(x.nbytes for x in __import__("jax").tree.leaves(self.engine._base))
        shapes = ((8, 1), (64, 1), (256, 1), (256, 8)) if self.smoke else ((64, 1), (256, 1), (256, 8))
        for rows, adapters in [(256, 1)] if self.quick else shapes:
            if self.budget.left() < (3 if self.smoke else 30):
                emit(phase="sample", figure="decode_ms_per_step", rows=rows, adapters=adapters, skipped="budget")
                continue

            def call(max_tokens: int, rows=rows, adapters=adapters):
                reqs = [
                    SampleInput(
                        prompt=prompt, max_tokens=max_tokens, seed=i, stop_token_ids=[], snapshot=f"s{i % adapters}"
                    )
                    for i in range(rows)
                ]
                t0 = time.perf_counter()
                res = self.engine.sample(reqs)
                bad = [r for r in res if not hasattr(r, "sequences")]
                if bad:
                    raise RuntimeError(f"sample refused: {bad[0]}")
                return time.perf_counter() - t0

            try:
                first = call(16)
                short, long_ = min(call(16) for _ in range(2)), min(call(64) for _ in range(2))
                per_step = (long_ - short) / 48
                kv_read = rows * (prompt_len + 40) * kv_token  # the mean filled length over the 48 steps
                emit(
                    phase="sample",
                    figure="decode_ms_per_step",
                    rows=rows,
                    adapters=adapters,
                    ms=round(per_step * 1000, 3),
                    first_call_s=round(first, 2),
                    weights_gib=round(weights / 2**30, 2),
                    kv_read_gib=round(kv_read / 2**30, 3),
                    bytes_per_step=weights + kv_read,
                    tokens_per_s=round(rows / per_step),
                )
            except Exception as e:  # noqa: BLE001
                emit(
                    phase="sample",
                    figure="decode_ms_per_step",
                    rows=rows,
                    adapters=adapters,
                    error=f"{type(e).__name__}: {str(e)[:400]}",
                )
        if self.budget.left() > (3 if self.smoke else 25):
            reqs = [
                SampleInput(prompt=prompt, max_tokens=64, seed=i, stop_token_ids=[], snapshot="s0") for i in range(256)
            ]
            profile_top("sample, 256 rows x 64 tokens, 1 adapter", lambda: self.engine.sample(reqs))

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
