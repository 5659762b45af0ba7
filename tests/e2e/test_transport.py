"""Which HTTP transport the unmodified SDK runs on, end to end (--client-transport).

pyqwest's asyncio transport reports a finished request from a Rust thread; when that lands while the client's
interpreter is finalizing, Python ends the thread with pthread_exit and the process dies of SIGABRT. A sampling
client always has a retrieve_futures long poll in flight, so the README's loop died that way after printing its
answer, 7 runs in 100. By default every client is told to use httpx; pyqwest stays a working choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tinkerflow.cli.launch import free_port
from tinkerflow.cli.up import served_models

pytestmark = pytest.mark.e2e

# A training step and a sample, then what the process holds. With pyqwest the script leaves by os._exit, past the
# interpreter's finalization, where that transport can abort (module docstring): this test is about the requests.
CLIENT = textwrap.dedent(
    """
    import json, os, sys
    import tinker
    from tinker import types

    model = sys.argv[1]
    training = tinker.ServiceClient().create_lora_training_client(base_model=model, rank=4).result()
    tokens = list(range(3, 23))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=3, temperature=0.0)
    sample = sampler.sample(types.ModelInput.from_ints(tokens[:5]), num_samples=1, sampling_params=params).result()
    pyqwest = "pyqwest" in sys.modules
    print(json.dumps({"loss": loss, "sampled": len(sample.sequences[0].tokens), "pyqwest": pyqwest}), flush=True)
    if pyqwest:
        os._exit(0)
    """
)


def _run_client(base_url: str, api_key: str, model: str, tmp_path: Path) -> dict:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    env = dict(os.environ, TINKER_BASE_URL=base_url, TINKER_API_KEY=api_key, TINKER_TELEMETRY="0")
    env["PYTHONFAULTHANDLER"] = "1"
    run = subprocess.run(
        [sys.executable, str(script), model], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert run.returncode == 0, f"exit {run.returncode}\n--- stdout\n{run.stdout}--- stderr\n{run.stderr}"
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    assert answer["loss"] > 0 and answer["sampled"] == 3, answer
    return answer


def test_sdk_clients_are_told_to_use_httpx_and_never_load_pyqwest(stack, base_model, tmp_path):
    assert _run_client(stack.base_url, stack.api_key, base_model, tmp_path)["pyqwest"] is False


def test_an_api_replica_with_client_transport_pyqwest_serves_the_sdk_over_pyqwest(stack, base_model, tmp_path):
    # A second API on the same stack, with the first one's settings (its environment), on its own port.
    environ = Path(f"/proc/{stack.parts()['api']['pid']}/environ").read_text().split("\0")
    env = dict(line.split("=", 1) for line in environ if "=" in line)
    port = free_port()
    env |= {"TINKERFLOW_PORT": str(port), "TINKERFLOW_CLIENT_TRANSPORT": "pyqwest"}
    log = (tmp_path / "api-pyqwest.log").open("wb")
    api = subprocess.Popen(
        [sys.executable, "-m", "tinkerflow.cli.main", "api"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not served_models(base_url, stack.api_key):  # the readiness `up` waits for: it answers, sees the model
            assert api.poll() is None, (tmp_path / "api-pyqwest.log").read_text()
            assert time.monotonic() < deadline, "the second API never served the model"
            time.sleep(0.2)
        assert _run_client(base_url, stack.api_key, base_model, tmp_path)["pyqwest"] is True
    finally:
        api.terminate()
        api.wait(timeout=30)
        log.close()
