"""Train the service's model until it translates Pig Latin: what `bash scripts/demo.sh` runs against the stack.

    python scripts/demo_learn.py [BASE_URL] [--max-steps N] [--learning-rate LR] [--rank R]

It trains a LoRA adapter of the served model (the embedded tiny Qwen3 under `tinkerflow up`, a random-weight model
that knows no language) on a few Pig Latin pairs at a learning rate that memorises them, printing the loss of every
step, and stops once greedy sampling of a trained prompt returns its translation, or at the step cap, saying which.
Then it draws the loss curve in the terminal and names the run (the console lists it under that id).

Only the unmodified `tinker` SDK (and what it installs) is used, as any client would. BASE_URL defaults to
$TINKER_BASE_URL or http://127.0.0.1:8000; the key comes from $TINKER_API_KEY. It exits 0 once the model has
learned (the sampled translation is exactly right), 1 when the step cap came first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# transformers (the SDK's tokenizer) warns on import that PyTorch is absent, which is fine for a client.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import tinker  # after the variable above, which transformers reads on import
from tinker import types

PAIRS = [
    ("banana split", "anana-bay plit-say"),
    ("quantum physics", "uantum-qay ysics-phay"),
    ("coding wizard", "oding-cay izard-way"),
    ("hello world", "ello-hay orld-way"),
]
PROBE = 2  # the pair whose translation is sampled
# Greedy decoding picks each token with probability > 1/2 whatever the others do, so once every completion token of
# the probe has p > CONFIDENT under teacher forcing, greedy sampling reproduces it; the margin over 1/2 covers the
# small sampler/trainer differences. Only then is the sampler asked (a save and a sampler compile each time).
CONFIDENT = 0.6
SPARK = "▁▂▃▄▅▆▇█"


def datum(tokenizer, english: str, pig: str) -> tuple[types.Datum, list[int]]:
    prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)
    completion = tokenizer.encode(f" {pig}\n\n", add_special_tokens=False)
    tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    return d, weights[1:]


def sparkline(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def chart(losses: list[float], height: int = 8, width: int = 60) -> str:
    """Loss against step as rows of text: a column per step (or per group of steps when there are many)."""
    per = max(1, math.ceil(len(losses) / width))
    cols = [sum(losses[i : i + per]) / len(losses[i : i + per]) for i in range(0, len(losses), per)]
    lo, hi = min(cols), max(cols)
    span = (hi - lo) or 1.0
    levels = [round((c - lo) / span * (height - 1)) for c in cols]
    rows = []
    for r in range(height - 1, -1, -1):
        label = f"{hi if r else lo:7.3f} │" if r in (0, height - 1) else "        │"
        rows.append(label + "".join("●" if lv == r else ("│" if lv > r else " ") for lv in levels))
    rows.append("        └" + "─" * len(cols))
    rows.append(f"         step 1{' ' * max(1, len(cols) - 6 - len(str(len(losses))))}{len(losses)}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("base_url", nargs="?", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--max-steps", type=int, default=60, help="stop training here if it has not translated yet")
    parser.add_argument("--learning-rate", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    args = parser.parse_args()

    started = time.monotonic()
    api_key = os.environ.get("TINKER_API_KEY", "tml-dummy")
    service = tinker.ServiceClient(base_url=args.base_url, api_key=api_key)
    model = os.environ.get("TINKERFLOW_BASE_MODEL") or ""
    if not model:
        capabilities = tinker.RestClient(base_url=args.base_url, api_key=api_key).get_server_capabilities().result()
        model = capabilities.supported_models[0].model_name or ""
    training = service.create_lora_training_client(base_model=model, rank=args.rank).result()
    tokenizer = training.get_tokenizer()
    data = [datum(tokenizer, english, pig) for english, pig in PAIRS]
    english, expected = PAIRS[PROBE]
    print(
        f"\nTeaching {model} Pig Latin ({len(PAIRS)} pairs, lr {args.learning_rate:g}, LoRA rank {args.rank}, "
        f"run {training.model_id})",
        flush=True,
    )

    losses: list[float] = []
    translation, learned = "", False
    for step in range(1, args.max_steps + 1):
        out = training.forward_backward([d for d, _ in data], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=args.learning_rate, grad_clip_norm=1.0)).result()
        logprobs = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
        total = sum(lp * w for (_, ws), lps in zip(data, logprobs) for lp, w in zip(lps, ws))
        losses.append(-total / sum(sum(ws) for _, ws in data))
        probe = [lp for lp, w in zip(logprobs[PROBE], data[PROBE][1]) if w]
        print(f"step {step:3d}  loss {losses[-1]:8.4f}  {sparkline(losses)}", flush=True)
        # The logprobs are those of the weights before this step's update, so a confident probe means the updated
        # weights are (at least) as good: sample them.
        if min(probe) > math.log(CONFIDENT) or step == args.max_steps:
            sampler = training.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(tokenizer.encode(f"English: {english}\nPig Latin:"))
            params = types.SamplingParams(max_tokens=24, temperature=0.0, stop=["\n"])
            result = sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
            translation = str(tokenizer.decode(result.sequences[0].tokens)).strip()
            learned = translation == expected
            print(f"         sample: English: {english} → Pig Latin: {translation!r}", flush=True)
            if learned:
                break

    elapsed = time.monotonic() - started
    print(f"\nLoss by step (cross-entropy per completion token):\n{chart(losses)}\n")
    # The stack may stop right after this script (`tinkerflow up -- ...`): name the run, not a URL that may be gone.
    if learned:
        print(
            f"Learned: '{english}' → '{translation}' after {len(losses)} steps ({elapsed:.0f} s); "
            f"the loss fell from {losses[0]:.2f} to {losses[-1]:.2f}. The run is {training.model_id}."
        )
        return 0
    print(
        f"Not learned within the step cap of {args.max_steps} ({elapsed:.0f} s): the sample reads "
        f"{translation!r}, the translation is {expected!r}. Try --max-steps or --learning-rate."
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
