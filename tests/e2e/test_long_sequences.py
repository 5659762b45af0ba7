"""Real sizes through the unmodified SDK against `tinkerflow up`: a copy of the embedded tiny model whose config allows
40,960 positions (as every real Qwen3 does).

- forward_backward of one datum, and a 1-token sample after a prompt, of 2K, 8K, 16K, 32K and 40,960 tokens all
  answer (2K and 8K in the default run, the rest under -m slow); the JAX worker's memory high-water after 32K stays
  under 6 GB; 40,961 tokens is a user error naming the limit.
- On a worker whose device-memory plan is small (--device-memory-gb), a datum larger than the plan is refused as that
  tenant's user error before anything is allocated, while another tenant's training loop runs through it unharmed,
  and the JAX worker is the same process before and after.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import API_KEY, OTHER_API_KEY
from tinkerflow.cli.launch import launch
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e

POSITIONS = 40960
TIMEOUT_S = 1200  # a 40,960-token forward_backward of the tiny model takes a minute or two on two CPU cores


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    directory = make_tiny_model(tmp_path_factory.mktemp("tiny-40k") / "model", progress=False)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _stack(tmp_path_factory, model: Path, *extra: str):
    return launch(
        tmp_path_factory.mktemp("long") / "state",
        api_key=API_KEY,
        extra=[
            "--base-model",
            str(model),
            "--max-lora-adapters",
            "4",
            "--warm-up",
            "off",
            "--api-key",
            OTHER_API_KEY,
            *extra,
        ],
    )


def _datum(n: int, seed: int = 0) -> types.Datum:
    s = np.random.default_rng(seed).integers(1, 2000, n + 1).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens=s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})  # pyright: ignore[reportArgumentType] (Datum converts lists)


def _high_water_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _user_error(future) -> tinker.RequestFailedError:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=TIMEOUT_S)
    assert str(info.value.category).endswith("user"), info.value
    return info.value


# The ladder to the limit takes four minutes on two cores: the default run climbs to 8K, `-m slow` to 40,960 (and
# checks the memory high-water at 32K); tests/engine/test_long_sequences.py holds memory linear in length by default.
LADDERS = [
    pytest.param((2048, 8192), id="to-8k"),
    pytest.param((2048, 8192, 16384, 32768, POSITIONS), id="to-the-limit", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("ladder", LADDERS)
def test_long_sequences_train_and_sample_through_the_sdk(tmp_path_factory, long_model, ladder):
    stack = _stack(tmp_path_factory, long_model)
    try:
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        pid = stack.parts()["jax-worker"]["pid"]
        for n in ladder:
            out = training.forward_backward([_datum(n, n)], "cross_entropy").result(timeout=TIMEOUT_S)
            assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == n
            assert np.isfinite(out.metrics["loss:sum"])
            prompt = types.ModelInput.from_ints(tokens=_datum(n - 1, n).model_input.to_ints())
            sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=1)).result(timeout=TIMEOUT_S)
            assert len(sample.sequences[0].tokens) == 1
            if n == 32768:
                assert _high_water_bytes(pid) < 6 * 2**30, f"JAX worker memory high-water {_high_water_bytes(pid)}"
        err = _user_error(training.forward_backward([_datum(POSITIONS + 1)], "cross_entropy"))
        assert "40961" in str(err) and "max_position_embeddings=40960" in str(err)
        assert stack.parts()["jax-worker"]["pid"] == pid  # the same process throughout
    finally:
        stack.stop()


def test_a_request_bigger_than_the_plan_is_refused_while_another_tenant_trains(tmp_path_factory, long_model):
    stack = _stack(tmp_path_factory, long_model, "--device-memory-gb", "2.5")
    try:
        model = stack.served_model()
        pid = stack.parts()["jax-worker"]["pid"]
        other = tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER_API_KEY)
        theirs = other.create_lora_training_client(base_model=model, rank=8).result()
        losses: list[float] = []
        failures: list[BaseException] = []
        running = threading.Event()

        def their_loop() -> None:
            try:
                for step in range(6):
                    out = theirs.forward_backward([_datum(64, 1), _datum(48, 2)], "cross_entropy").result(timeout=600)
                    losses.append(out.metrics["loss:sum"])
                    theirs.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=600)
                    if step == 0:
                        running.set()
            except BaseException as e:  # reported by the main thread
                failures.append(e)
                running.set()

        loop = threading.Thread(target=their_loop, name="other-tenant")
        loop.start()
        assert running.wait(600)
        mine = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
        training = mine.create_lora_training_client(base_model=model, rank=8).result()
        err = _user_error(training.forward_backward([_datum(32000)], "cross_entropy"))
        assert "32,000 tokens" in str(err) and "this worker fits" in str(err) and "--device-memory-gb" in str(err)
        # The refused request cost nothing: the same client trains right after.
        out = training.forward_backward([_datum(100)], "cross_entropy").result(timeout=600)
        assert np.isfinite(out.metrics["loss:sum"])
        loop.join(1200)
        assert not failures, failures
        assert len(losses) == 6 and losses[-1] < losses[0]
        assert stack.parts()["jax-worker"]["pid"] == pid
    finally:
        stack.stop()
