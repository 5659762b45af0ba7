"""Under `tinkerflow up`, kill -9 one part at a time mid-loop and time until the loop's next answer; one JSON line
per part, and one saying whether the faulted loop's losses equal a fault-free loop's with the same seed.

The loop is Pig Latin-like (the shared acceptance script's examples, tokenized by the served model's tokenizer):
forward_backward + optim_step per step, then a greedy sample. `up` restarts each killed part (supervise.py); runs on
the restarted JAX worker restore themselves from their automatic snapshot plus the ops since.

    python -m benchmarks.supervised_recovery                       # kills jax-worker, workflow-worker, api, temporal
    python -m benchmarks.supervised_recovery --part api --steps 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import PIG_LATIN, emit

PARTS = ("jax-worker", "workflow-worker", "api", "temporal")
SEED = 7
SNAPSHOT_EVERY = 2  # so a JAX worker kill exercises both restoring a snapshot and replaying the ops since


@dataclass
class LoopResult:
    losses: list[float]
    tokens: list[int]
    seconds_to_answer: dict[str, float] = field(default_factory=dict)  # part killed -> kill to the next answer


def _datums(tokenizer):
    from tinker import types

    out = []
    for example in PIG_LATIN:
        prompt = tokenizer.encode(f"English: {example['input']}\nPig Latin:", add_special_tokens=True)
        completion = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
        tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
            )
        )
    return out


def pig_latin_loop(stack, steps: int, kill_at: dict[int, str] | None = None, sample: bool = True) -> LoopResult:
    """Train `steps` steps with a fixed seed; at step i in `kill_at`, kill -9 that part of `up` while the step's
    forward_backward and optim_step are in flight, and time until the forward_backward's answer. Then (`sample`)
    a greedy sample of the trained weights (its programs compile once per JAX worker process: minutes on a busy
    CPU)."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    training = service.create_lora_training_client(base_model=stack.served_model(), rank=8, seed=SEED).result()
    tokenizer = training.get_tokenizer()
    data = _datums(tokenizer)
    result = LoopResult(losses=[], tokens=[])
    for step in range(steps):
        fwdbwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        part = (kill_at or {}).get(step)
        if part:
            stack.kill_part(part)
            killed = time.perf_counter()
        result.losses.append(fwdbwd.result(timeout=900).metrics["loss:sum"])
        if part:
            result.seconds_to_answer[part] = round(time.perf_counter() - killed, 2)
        optim.result(timeout=900)
    if not sample:
        return result
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: coding wizard\nPig Latin:"))
    sampled = sampler.sample(
        prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0, seed=SEED)
    )
    result.tokens = list(sampled.result(timeout=900).sequences[0].tokens)
    return result


def launch_stack(state_dir: Path, api_key: str = "tml-supervised"):
    from tinkerflow.cli.launch import launch

    # A short first backoff: the figures are about recovery, not about waiting out the default 1 s.
    return launch(
        state_dir, api_key=api_key, extra=["--auto-snapshot-every", str(SNAPSHOT_EVERY), "--restart-backoff-s", "0.5"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, action="append", help="which part to kill (repeatable; default all)")
    parser.add_argument("--steps", type=int, default=0, help="steps per loop (default: two per part killed, + 1)")
    args = parser.parse_args()
    parts = args.part or list(PARTS)
    steps = args.steps or 2 * len(parts) + 1
    kill_at = {1 + 2 * i: part for i, part in enumerate(parts)}
    stack = launch_stack(Path(tempfile.mkdtemp(prefix="tinkerflow-bench-supervised-")) / "state")
    try:
        reference = pig_latin_loop(stack, steps)
        faulted = pig_latin_loop(stack, steps, kill_at)
        for part, seconds in faulted.seconds_to_answer.items():
            emit(
                figure="answer_after_kill_under_up",
                part=part,
                seconds_to_answer=seconds,
                snapshot_every=SNAPSHOT_EVERY,
                restarts=stack.parts()[part]["restarts"],
            )
        emit(
            figure="losses_after_kills_equal_fault_free",
            parts_killed=len(kill_at),
            steps=steps,
            equal=faulted.losses == reference.losses and faulted.tokens == reference.tokens,
            max_abs_diff=max(abs(a - b) for a, b in zip(faulted.losses, reference.losses)),
        )
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
