"""One JAX-worker lifetime in miniature, run as its own process by test_persistent_cache.py: torch kept out and the
persistent compilation cache on (as the jax-worker command does), the engine started as the worker starts it (loaded
and warmed up, `--warm-up ready` with small shapes), one training step and one sample, then the cache counters and
the programs the steps built after the warm-up as one JSON line.

    python persistent_cache_scenario.py MODEL_DIR CACHE_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main(model_dir: str, cache_dir: str) -> None:
    from tinkerflow.workers import jax_worker

    jax_worker.keep_torch_out()
    from tinkerflow.workers.engine.runtime import persistent_cache

    persistent_cache.enable(Path(cache_dir))  # before anything compiles, as the JAX worker does

    from tinkerflow.common.settings import Settings
    from tinkerflow.workers.engine.types import (
        AdamConfig,
        Datum,
        ForwardBackwardInput,
        ForwardBackwardResult,
        LoraConfig,
        SampleInput,
        SampleResult,
    )

    settings = Settings(
        max_lora_adapters=2,
        max_lora_rank=8,
        warm_up="ready",
        warm_up_train_rows=(1,),
        warm_up_train_lens=(16,),
        warm_up_sampler_stacks=(1,),
        warm_up_scoring=False,
    )
    engine = jax_worker.start_engine(settings, model_dir)
    warmed = persistent_cache.counts()
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    tokens = np.arange(1, 17, dtype=np.int32)
    datum = Datum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    (fb,) = engine.forward_backward([ForwardBackwardInput(slot=0, data=[datum], loss_fn="cross_entropy")])
    engine.optim_step(0, AdamConfig(learning_rate=1e-3))
    engine.snapshot(0, "s")
    (sampled,) = engine.sample([SampleInput(prompt=tokens[:8], max_tokens=4, seed=3, snapshot="s")])
    assert isinstance(fb, ForwardBackwardResult) and isinstance(sampled, SampleResult), (fb, sampled)
    counts = persistent_cache.counts()
    print(
        json.dumps(
            {
                "hits": counts.hits,
                "misses": counts.misses,
                "loss": fb.metrics["loss:sum"],
                "tokens": sampled.sequences[0].tokens,
                "warm_up_programs": warmed.requests,
                "after_warm_up": counts.requests - warmed.requests,
                "torch": "torch" in sys.modules and sys.modules["torch"] is not None,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
