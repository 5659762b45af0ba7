"""Orchestration overhead: each op through the SDK (HTTP → Temporal → JAX worker → back) vs the same engine call
made in-process. Prints one JSON line per figure.

    python benchmarks/overhead.py [--base-url URL] [--iterations N]

Without --base-url it launches `tinkerflow up` on free ports with the embedded tiny model. The in-process engine
loads the same model directory the stack serves.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx
import numpy as np
import tinker
from tinker import types

from benchmarks.common import emit, pig_latin_examples, running_stack, stats, time_ms

API_KEY = "tml-bench-key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack instead of launching one")
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()

    with running_stack(args.base_url, args.api_key) as (base_url, _stack):
        service = tinker.ServiceClient(base_url=base_url, api_key=args.api_key)
        caps = httpx.get(f"{base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": args.api_key}).json()
        base_model = caps["supported_models"][0]["model_name"]
        training = service.create_lora_training_client(base_model=base_model, rank=32).result()
        tokenizer = training.get_tokenizer()
        rows = pig_latin_examples(tokenizer)
        batch = [
            types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs=dict(target_tokens=y, weights=w))  # pyright: ignore[reportArgumentType] (Datum converts lists)
            for t, y, w in rows
        ]
        one = batch[:1]
        adam = types.AdamParams(learning_rate=1e-4)
        info_body = {"model_id": training.model_id, "type": "get_info"}
        http = httpx.Client(headers={"X-API-Key": args.api_key})

        sdk_ops = {
            # The SDK caches get_info per client, so the route is timed with a plain HTTP client.
            "get_info": lambda: http.post(f"{base_url}/api/v1/get_info", json=info_body).raise_for_status(),
            "forward_1_datum": lambda: training.forward(one, "cross_entropy").result(),
            "forward_backward_pig_latin": lambda: training.forward_backward(batch, "cross_entropy").result(),
            "optim_step": lambda: training.optim_step(adam).result(),
        }
        sdk = {}
        for name, fn in sdk_ops.items():
            time_ms(fn, 3)  # warm-up: compiles every shape first
            sdk[name] = stats(time_ms(fn, args.iterations))
        # Same weights the stack serves (its directory is the tokenizer_id get_info reports); the stack is idle now.
        model_dir = training.get_info().model_data.tokenizer_id
        assert model_dir is not None  # this stack reports its model directory there
        engine = _engine_figures(model_dir, rows, args.iterations)
    for name in sdk_ops:
        emit(figure=f"{name}_ms", path="sdk", **sdk[name])
        emit(figure=f"{name}_ms", path="engine", **engine[name])
        emit(
            figure=f"{name}_overhead_ms",
            median_ms=round(sdk[name]["median_ms"] - engine[name]["median_ms"], 3),
            p90_ms=round(sdk[name]["p90_ms"] - engine[name]["p90_ms"], 3),
        )


def _engine_figures(model_dir: str, rows, iterations: int) -> dict:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig

    engine = Engine.load(model_dir, max_lora_adapters=8, max_lora_rank=32, progress=False)
    engine.create_adapter(0, LoraConfig(rank=32))
    data = [
        Datum(
            tokens=np.asarray(t, np.int32),
            inputs={"target_tokens": np.asarray(y, np.int64), "weights": np.asarray(w, np.float32)},
        )
        for t, y, w in rows
    ]
    ops = {
        "get_info": lambda: engine.info,
        "forward_1_datum": lambda: engine.forward_backward(
            [ForwardBackwardInput(0, data[:1], "cross_entropy", forward_only=True)]
        ),
        "forward_backward_pig_latin": lambda: engine.forward_backward([ForwardBackwardInput(0, data, "cross_entropy")]),
        "optim_step": lambda: engine.optim_step(0, AdamConfig(learning_rate=1e-4)),
    }
    out = {}
    for name, fn in ops.items():
        time_ms(fn, 3)
        out[name] = stats(time_ms(fn, iterations))
    return out


if __name__ == "__main__":
    main()
