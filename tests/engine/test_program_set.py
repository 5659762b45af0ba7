"""The bounded program set (docs/architecture.md): the warm-up compiles at most PROGRAM_BOUND programs, the whole
set, and a mixed workload after it compiles nothing, for each family the worker serves that has its own sampler
state (the tiny Qwen3 and the tiny Qwen3.5, whose hybrid cache holds recurrent state beside the KV blocks).

The workload is benchmarks/program_count.py's, shorter: each tiny model with 16,384 positions; sample calls
with prompts of 1 … 8,192 tokens, 1 … 64 rows, 0 … 16 snapshots, with and without stops, prompt logprobs, target
logprobs, prompt draws, top-k and prefix hits; forward_backward and forward calls of 1 … 8 datums of 1 … 4,096
tokens. Counted by the engine's own compile caches (every program a request can wait for).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.program_count import counts, run, workload

# The bound the long-lived worker is held to, per model and device (docs/architecture.md: the set is 48 here).
PROGRAM_BOUND = 64
POSITIONS = 16384


# Qwen3.5's counts are the same rule's, taken in the slow run: its warm-up and workload take as long again.
FAMILIES = ["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tmp_path_factory):
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
    from tinkerflow.workers.engine.types import LoraConfig

    model = make_tiny_model(tmp_path_factory.mktemp("programs") / "tiny", family=request.param, progress=False)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (model / "config.json").write_text(json.dumps(config))
    engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.create_adapter(0, LoraConfig(rank=8, seed=0))
    return engine


@pytest.mark.timeout(1800)
def test_the_warm_up_builds_a_bounded_set_and_a_mixed_workload_compiles_nothing_after_it(engine):
    snapshots = [f"programs:sample:{n}" for n in range(16)]
    for key in snapshots:
        engine.snapshot(0, key)
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    # The extremes at least once, beside the random draws: the longest prompt alone, the most rows and snapshots,
    # every kind of prompt scoring, the widest top-k, rows past the largest slot bucket.
    first = workload(rng, 48, 8192, vocab)
    for n, rows, snaps, plp, targets, alt, topk in [
        (8192, 1, 0, False, 0, 0, 0),
        (1, 64, 16, True, 0, 0, 20),
        (3000, 64, 2, False, 3, 0, 0),
        (100, 5, 5, False, 0, 4, 5),
        (9, 300, 0, True, 64, 20, 1),
        (600, 16, 1, False, 0, 0, 0),
    ]:
        prompt = (np.arange(n, dtype=np.int32) % (vocab - 1)) + 1
        call = dict(prompt=prompt, rows=rows, snapshots=snaps, prompt_logprobs=plp, targets=targets, alt=alt)
        first.append({"kind": "sample", "stops": [5], "topk": topk, "max_tokens": 4, **call})
    from tinkerflow.workers.engine.types import WarmUpPlan

    engine.warm_up(WarmUpPlan().pieces())
    warmed = counts(engine)
    assert sum(warmed.values()) <= PROGRAM_BOUND, warmed
    run(engine, first, snapshots)
    assert counts(engine) == warmed, "the mixed workload compiled programs the warm-up had not built"
