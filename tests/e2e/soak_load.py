"""The soak's load (tests/e2e/test_soak.py): each SDK client's loop of training, saving and sampling, and the ledger
that times every request and records how it ended, to be judged once the load stops."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import tinker
from tinker import types

CLIENTS = 8
BASE_SAMPLERS = (2, 5)  # clients that also fire bursts of concurrent samples at the base model
PROVOKER = 0  # the client that sometimes sends an out-of-vocabulary batch
SAVE_EVERY = 3  # steps between save_weights_and_get_sampling_client
BURST = 12  # concurrent base-model sample futures per burst
RESULT_TIMEOUT_S = 300  # per future: far above any answer (a cold jit compile on 2 cores is ~tens of s)


@dataclass
class Request:
    kind: str
    client: int
    t0: float
    provoked: bool = False
    t1: float | None = None
    outcome: str = "pending"  # pending | ok | provoked (failed as meant to) | error: ...


@dataclass
class Ledger:
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, kind: str, client: int, submit, *args, provoked: bool = False, **kwargs):
        """Submit `submit(*args, **kwargs)` (timed from before the call); note when its future completes."""
        r = Request(kind, client, time.monotonic(), provoked)
        with self.lock:
            self.requests.append(r)
        try:
            future = submit(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 — every outcome is recorded and judged at the end
            r.t1, r.outcome = time.monotonic(), f"error at submit: {type(e).__name__}: {str(e)[:300]}"
            return r, None
        future.future().add_done_callback(lambda _f: setattr(r, "t1", time.monotonic()))
        return r, future

    def resolve(self, r: Request, future, check=None):
        """Wait for one future (never unbounded); record how it ended. Returns its result, or None."""
        if future is None:
            return None
        try:
            result = future.result(timeout=RESULT_TIMEOUT_S)
        except TimeoutError:
            r.outcome = f"error: no answer within {RESULT_TIMEOUT_S} s"
            return None
        except Exception as e:  # noqa: BLE001
            r.t1 = r.t1 or time.monotonic()
            meant = r.provoked and isinstance(e, tinker.RequestFailedError) and "1000000" in str(e)
            r.outcome = "provoked" if meant else f"error: {type(e).__name__}: {str(e)[:300]}"
            return None
        r.t1 = r.t1 or time.monotonic()
        if r.provoked:
            r.outcome = "error: the out-of-vocabulary batch succeeded"
            return None
        try:
            if check is not None:
                check(result)
        except AssertionError as e:
            r.outcome = f"error: wrong answer: {e}"
            return None
        r.outcome = "ok"
        return result

    def run(self, kind: str, client: int, submit, *args, check=None, **kwargs):
        """Submit and wait: the answer (or None, with the failure recorded)."""
        return self.resolve(*self.track(kind, client, submit, *args, **kwargs), check)


def _datum(rng: random.Random, n: int = 24) -> types.Datum:
    tokens = [rng.randrange(3, 1500) for _ in range(n + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )


def _check_fwdbwd(n_tokens: list[int]):
    def check(out) -> None:
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == n_tokens, "logprobs per datum"
        assert out.metrics["loss:sum"] == out.metrics["loss:sum"], "loss is NaN"

    return check


def _check_samples(num_samples: int, max_tokens: int):
    def check(out) -> None:
        assert len(out.sequences) == num_samples, f"{len(out.sequences)} sequences, wanted {num_samples}"
        assert all(len(s.tokens) == max_tokens for s in out.sequences), "sequence lengths"

    return check


@dataclass
class SoakClient:
    index: int
    service: tinker.ServiceClient
    training: object = None
    steps: int = 0
    warmed: threading.Event = field(default_factory=threading.Event)
    died: str = ""


def _prompt(rng: random.Random) -> types.ModelInput:
    return types.ModelInput.from_ints([rng.randrange(3, 1500) for _ in range(rng.randint(4, 12))])


OOV = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 10**6, 3]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},  # pyright: ignore[reportArgumentType] (Datum converts lists)
)


def client_loop(c: SoakClient, model: str, ledger: Ledger, stop: threading.Event) -> None:
    i, rng = c.index, random.Random(c.index)
    lora_params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[])
    base_params = types.SamplingParams(max_tokens=6, temperature=0.8, stop=[])
    try:
        c.training = ledger.run(
            "create_model", i, c.service.create_lora_training_client, base_model=model, rank=(4, 8)[i % 2]
        )
        if c.training is None:
            c.died = "create_lora_training_client failed"
            return
        base = None
        if i in BASE_SAMPLERS:
            base = ledger.run("create_sampling_client", i, c.service.create_sampling_client, base_model=model)
        while not stop.is_set():
            # fwd/bwd and optim_step pipelined, as the SDK means them to be (the run orders them by seq_id)
            fb = ledger.track(
                "forward_backward", i, c.training.forward_backward, [_datum(rng) for _ in range(4)], "cross_entropy"
            )
            bad = None
            if i == PROVOKER and c.steps % 5 == 4:
                bad = ledger.track(
                    "forward_backward", i, c.training.forward_backward, [OOV], "cross_entropy", provoked=True
                )
            opt = ledger.track("optim_step", i, c.training.optim_step, types.AdamParams(learning_rate=1e-4))
            ledger.resolve(*fb, _check_fwdbwd([24] * 4))
            if bad is not None:
                ledger.resolve(*bad)
            ledger.resolve(*opt)
            c.steps += 1
            if c.steps % SAVE_EVERY == 1:
                sampler = ledger.run(
                    "save_weights_and_get_sampling_client", i, c.training.save_weights_and_get_sampling_client
                )
                if sampler is not None:
                    futures = [
                        ledger.track(
                            "sample_lora",
                            i,
                            sampler.sample,
                            prompt=_prompt(rng),
                            num_samples=2,
                            sampling_params=lora_params,
                        )
                        for _ in range(2)
                    ]
                    for f in futures:
                        ledger.resolve(*f, _check_samples(2, 8))
            if base is not None:
                futures = [
                    ledger.track(
                        "sample_base", i, base.sample, prompt=_prompt(rng), num_samples=1, sampling_params=base_params
                    )
                    for _ in range(BURST)
                ]
                for f in futures:
                    ledger.resolve(*f, _check_samples(1, 6))
            if c.steps >= SAVE_EVERY + 1:  # one full cycle (train, save, sample lora and base) done
                c.warmed.set()
    except Exception as e:  # noqa: BLE001 — a client thread that dies is reported, not swallowed
        c.died = f"{type(e).__name__}: {e}"
    finally:
        c.warmed.set()
