"""The seed's Pig Latin loop (/work/shared/acceptance/pig_latin.py) with a fixed LoRA seed, so that two services
(a single-process `tinkerflow up`, `tinkerflow ray` on several processes) can be compared loss for loss. Used by
tests/e2e/test_ray.py and benchmarks/ray_group.py."""

from __future__ import annotations

import numpy as np

EXAMPLES = [
    ("banana split", "anana-bay plit-say"),
    ("quantum physics", "uantum-qay ysics-phay"),
    ("coding wizard", "oding-cay izard-way"),
]


def pig_latin(base_url: str, api_key: str, steps: int, on_step=None, sample: bool = False) -> list[float]:
    """/work/shared/acceptance/pig_latin.py's loop with a fixed LoRA seed, so two services can be compared; returns
    its per-step mean loss. `on_step(i, fwd_future)` runs with step i's forward_backward in flight. Sampling (whose
    first compile on two CPU processes costs minutes here) only where asked."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    model = service.get_server_capabilities().supported_models[0].model_name
    training = service.create_lora_training_client(base_model=model, rank=8, seed=5).result()  # pyright: ignore[reportArgumentType] (the stack fills these)
    tokenizer = training.get_tokenizer()
    data, weights = [], []
    for english, pig in EXAMPLES:
        prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)
        completion = tokenizer.encode(f" {pig}\n\n", add_special_tokens=False)
        tokens, w = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs=dict(weights=w[1:], target_tokens=tokens[1:]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
            )
        )
        weights += w[1:]
    weights = np.asarray(weights, np.float64)
    losses = []
    for i in range(steps):
        fwd = training.forward_backward(data, "cross_entropy")
        if on_step is not None:
            on_step(i, fwd)
        out = fwd.result(timeout=900)
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=900)
        logprobs = np.concatenate([o["logprobs"].tolist() for o in out.loss_fn_outputs])
        losses.append(float(-np.dot(logprobs, weights) / weights.sum()))
    if not sample:
        return losses
    sampler = training.save_weights_and_get_sampling_client()
    result = sampler.sample(
        types.ModelInput.from_ints(tokenizer.encode("English: coding wizard\nPig Latin:")),
        1,
        types.SamplingParams(max_tokens=6, temperature=0.0),
    ).result(timeout=900)
    assert result.sequences[0].tokens and len(result.sequences[0].logprobs) == len(result.sequences[0].tokens)  # pyright: ignore[reportArgumentType] (the stack fills these)
    return losses
