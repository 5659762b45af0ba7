"""What one tenant's big sampling load costs another tenant's small forward_backward (docs/architecture.md §What tenancy
promises); JSON lines.

Tenant B times forward_backward + optim_step alone, then again while tenant A keeps `--concurrency` asample calls of
the largest size the server admits (--max-samples-per-request samples of --max-tokens tokens) in flight. The problem
this answers: a single asample of 20,000 samples used to be admitted and took another tenant's forward_backward from
0.08 s to 4.5 s. Now it is refused (HTTP 400) and the Coordinator takes queued work round-robin over sessions.

Measured on the shared 2-core CPU box (load ~18, tiny model, --reps 5 --max-tokens 32 --concurrency 2): small step
alone 201 ms median; under two 128-sample calls in flight 6,539 ms median (p90 14,132 ms); 20,000 samples refused.
Round-robin order puts the small op in the very next batch, but that batch waits for the engine call in progress:
the latency bound is one big batch's duration, set by the per-request caps, until sampling batches are split.

    python -m benchmarks.fairness                     # launches a stack on the tiny model
    python -m benchmarks.fairness --base-url URL      # or measures a running one (TINKER_API_KEY)
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from benchmarks.common import emit, running_stack, stats


def measure(base_url: str, api_key: str, reps: int, samples: int, max_tokens: int, concurrency: int) -> None:
    import tinker
    from tinker import types

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
        loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0] * 4),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    adam = types.AdamParams(learning_rate=1e-4)
    tenant_b = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    model = tenant_b.get_server_capabilities().supported_models[0].model_name
    assert model is not None  # the stack names every model it serves
    small = tenant_b.create_lora_training_client(base_model=model, rank=8).result(timeout=900)

    def step() -> None:
        small.forward_backward([datum], "cross_entropy").result(timeout=900)
        small.optim_step(adam).result(timeout=900)

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1000)
        return out

    step()  # compile
    emit(figure="small_step_alone", **stats(timed(reps)))

    tenant_a = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    big = tenant_a.create_lora_training_client(base_model=model, rank=8).result(timeout=900)
    sampler = big.save_weights_and_get_sampling_client().result(timeout=900)
    prompt = types.ModelInput.from_ints(list(range(1, 33)))
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=900)  # compile
    stop = threading.Event()
    done = [0]

    def flood() -> None:
        while not stop.is_set():
            sampler.sample(prompt, num_samples=samples, sampling_params=params).result(timeout=900)
            done[0] += 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the flood is under way
    under_load = timed(reps)
    stop.set()
    emit(
        figure="small_step_under_big_sampling",
        samples_per_call=samples,
        max_tokens=max_tokens,
        concurrent_calls=concurrency,
        big_calls_done=done[0],
        **stats(under_load),
    )
    try:
        sampler.sample(prompt, num_samples=20_000, sampling_params=params).result(timeout=900)
        refused = False
    except tinker.BadRequestError:
        refused = True
    emit(figure="asample_20000_samples_refused", refused=refused)
    for t in threads:
        t.join(timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running stack (default: launch one)")
    parser.add_argument("--reps", type=int, default=10, help="timed small steps per figure (default 10)")
    parser.add_argument("--samples", type=int, default=128, help="samples per big asample (default 128, the cap)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each big sample (default 64)")
    parser.add_argument("--concurrency", type=int, default=4, help="big asample calls in flight (default 4)")
    args = parser.parse_args()
    api_key = os.environ.get("TINKER_API_KEY", "tml-bench")
    with running_stack(args.base_url, api_key) as (base_url, _):
        measure(base_url, api_key, args.reps, args.samples, args.max_tokens, args.concurrency)


if __name__ == "__main__":
    main()
