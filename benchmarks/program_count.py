"""How many programs the engine compiles over a mixed workload, and whether a second pass over the same kinds of
work compiles anything: the bounded program set of a long-lived JAX worker (docs/architecture.md §The bounded
program set).

    python -m benchmarks.program_count [--requests 120] [--max-prompt 8192] [--seed 0]

The workload (engine alone, the embedded tiny model with `--positions` positions): sample calls with prompts of
1 … `--max-prompt` tokens, 1 … 64 rows, 0 … 16 distinct sampler snapshots in one call, with and without stop
tokens, prompt logprobs, target logprobs, prompt draws, top-k sample logprobs and prefix-cache hits (prompts repeated
in one cache namespace), and forward_backward and forward calls of 1 … 8 datums of 1 … 4,096 tokens each; then a
second pass, drawn afresh from the same kinds. `tests/engine/test_program_set.py` runs a shorter one.

Figures (one JSON line each):
* `programs_compiled`: programs built over the first pass, by AotCache (`sample_admit`, `sample_decode`,
  `sample_slots`, `train step`, `forward step`) and in all (`backend_compiles`: every XLA compile JAX reports,
  the small helper programs around them included), with the seconds they took.
* `programs_compiled_second_pass`: the same for the second pass; a bounded set compiles nothing there.
There is no engine-alone baseline to give beside these: they are the engine's own counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import emit

ROW_COUNTS = (1, 2, 5, 16, 64)
SNAPSHOT_COUNTS = (0, 1, 2, 5, 16)
TRAIN_LENGTHS = (1, 7, 33, 130, 600, 2000, 4096)
log = logging.getLogger("benchmarks.program_count")


class BackendCompiles:
    """Counts XLA backend compiles (JAX's monitoring event per compile) and their seconds."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration_secs


def prompt_lengths(max_prompt: int) -> list[int]:
    return sorted({n for n in (1, 3, 17, 90, 300, 1100, 4000, max_prompt) if n <= max_prompt})


def workload(rng: np.random.Generator, n: int, max_prompt: int, vocab: int) -> list[dict]:
    """`n` calls of the kinds in the module docstring, as plain dicts (what `run` turns into engine inputs)."""
    lengths = prompt_lengths(max_prompt)
    seen: list[np.ndarray] = []
    calls = []
    for _ in range(n):
        if rng.random() < 0.25:
            datums = [rng.integers(1, vocab, int(rng.choice(TRAIN_LENGTHS)) + 1) for _ in range(rng.integers(1, 9))]
            calls.append({"kind": "train", "datums": datums, "forward_only": bool(rng.random() < 0.3)})
            continue
        if seen and rng.random() < 0.3:  # a prefix-cache hit: an earlier prompt, a new ending
            base = seen[int(rng.integers(len(seen)))]
            prompt = np.concatenate([base, rng.integers(1, vocab, int(rng.integers(1, 20)))])[:max_prompt]
        else:
            prompt = rng.integers(1, vocab, int(rng.choice(lengths)))
        seen.append(prompt)
        calls.append(
            {
                "kind": "sample",
                "prompt": prompt.astype(np.int32),
                "rows": int(rng.choice(ROW_COUNTS)),
                "snapshots": int(rng.choice(SNAPSHOT_COUNTS)),
                "stops": [int(x) for x in rng.integers(1, vocab, int(rng.integers(0, 3)))]
                if rng.random() < 0.5
                else None,
                "prompt_logprobs": bool(rng.random() < 0.2),
                "targets": int(rng.choice((1, 3, 64))) if rng.random() < 0.1 else 0,
                "alt": int(rng.choice((1, 4, 20))) if rng.random() < 0.1 else 0,
                "topk": int(rng.choice((1, 5, 20))) if rng.random() < 0.2 else 0,
                "max_tokens": int(rng.choice((1, 8, 32))),
            }
        )
    return calls


def run(engine, calls: list[dict], snapshots: list[str]) -> None:
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, SampleInput

    for call in calls:
        if call["kind"] == "train":
            data = [Datum(s[:-1].astype(np.int32), {"target_tokens": s[1:].astype(np.int32)}) for s in call["datums"]]
            req = ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy", forward_only=call["forward_only"])
            [res] = engine.forward_backward([req])
            assert not isinstance(res, Exception), res
            continue
        n = call["snapshots"]
        keys = snapshots[:n] if n else [None]
        per = max(1, call["rows"] // len(keys))
        requests = [
            SampleInput(
                prompt=call["prompt"],
                num_samples=per,
                max_tokens=call["max_tokens"],
                seed=7,
                snapshot=key,
                stop_token_ids=call["stops"],
                include_prompt_logprobs=call["prompt_logprobs"],
                target_prompt_logprobs=_targets(call["prompt"], call["targets"]) if call["targets"] else None,
                prompt_alt_tokens_k=call["alt"],
                topk_sample_logprobs=call["topk"],
                cache_namespace="bench",
            )
            for key in keys
        ]
        for res in engine.sample(requests):
            assert not isinstance(res, Exception), res


def _targets(prompt: np.ndarray, k: int) -> np.ndarray | None:
    """Target ids for every prompt position after the first: the next prompt token, then -1 (none)."""
    if len(prompt) < 2:
        return None
    out = np.full((len(prompt) - 1, k), -1, np.int64)
    out[:, 0] = prompt[1:]
    return out


def counts(engine) -> dict[str, int]:
    caches = [*engine.sampler.caches(), engine.steps.grad_step, engine.steps.forward_step]
    return {c.name: c.compiles for c in caches}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=120, help="calls per pass (default 120)")
    parser.add_argument("--max-prompt", type=int, default=8192, help="longest prompt, tokens (default 8192)")
    parser.add_argument("--positions", type=int, default=16384, help="the model's context (default 16384)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
    from tinkerflow.workers.engine.types import LoraConfig

    with tempfile.TemporaryDirectory(prefix="tinkerflow-programs-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", progress=False)
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = args.positions
        (model / "config.json").write_text(json.dumps(config, indent=2))
        engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
        engine.create_adapter(0, LoraConfig(rank=8, seed=0))
        snapshots = [f"bench:sample:{n}" for n in range(max(SNAPSHOT_COUNTS))]
        for key in snapshots:
            engine.snapshot(0, key)
        backend = BackendCompiles()
        rng = np.random.default_rng(args.seed)
        vocab = engine.info.vocab_size
        for figure in ("programs_compiled", "programs_compiled_second_pass"):
            before, compiles, seconds, t0 = counts(engine), backend.count, backend.seconds, time.perf_counter()
            run(engine, workload(rng, args.requests, args.max_prompt, vocab), snapshots)
            after = counts(engine)
            by_cache = {name: after[name] - before[name] for name in after}
            emit(
                figure=figure,
                unit="programs",
                value=sum(by_cache.values()),
                by_cache=by_cache,
                backend_compiles=backend.count - compiles,
                compile_s=round(backend.seconds - seconds, 1),
                wall_s=round(time.perf_counter() - t0, 1),
                requests=args.requests,
                max_prompt=args.max_prompt,
            )


if __name__ == "__main__":
    main()
