"""One sampler row as the admission and sampler tests build them: a prompt sampled once at temperature 1 with no
top-k/top-p cut and no stop list, on the base model unless `fields` say otherwise."""

from __future__ import annotations

from typing import Any

import numpy as np

from tinkerflow.workers.engine.sampling.rows import SampleRow


def sample_row(prompt: np.ndarray, **fields: Any) -> SampleRow:
    """`prompt`'s row, needing logprobs from its last token; `fields` override any other SampleRow field."""
    base: dict[str, Any] = dict(
        prompt=prompt,
        max_tokens=1,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        seed=(0, 0),
        sample_index=0,
        stop_ids=[],
        adapter=-1,
        scale=1.0,
        cache_namespace=("ns",),
        needs_from=len(prompt) - 1,
    )
    return SampleRow(**(base | fields))
