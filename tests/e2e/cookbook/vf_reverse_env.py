"""A Verifiers environment written here (as an Environments Hub module is: a module with `load_environment`), for
recipes.verifiers_rl offline: reverse a short text, rewarded by the share of characters in place."""

from __future__ import annotations

import verifiers as vf  # pyright: ignore[reportMissingImports]  (installed only where that xfail test runs)
from datasets import Dataset

WORDS = ["stone", "river", "lamp", "window", "garden", "cloud", "paper", "bridge"]


def load_environment(**kwargs) -> vf.Environment:
    texts = [f"{a} {b}" for a in WORDS for b in WORDS if a != b][:32]
    dataset = Dataset.from_dict({"question": texts, "answer": [t[::-1] for t in texts]})

    def in_place(completion, answer, **_) -> float:
        text = completion[-1]["content"] if isinstance(completion, list) and completion else str(completion)
        return sum(a == b for a, b in zip(text.strip(), answer, strict=False)) / max(len(answer), 1)

    return vf.SingleTurnEnv(
        dataset=dataset,
        system_prompt="Reverse the text, character by character.",
        rubric=vf.Rubric(funcs=[in_place], weights=[1.0]),
        **kwargs,
    )
