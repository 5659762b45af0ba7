# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""Multi-host JAX worker: the leader/follower protocol (in-process, with fake engines and a fake key-value store), the
CLI flags, and 2 real CPU processes joined by jax.distributed (gloo collectives) that together train and sample on
an fsdp=2 mesh spanning both, matching this process's 1-device engine.

The 2-process test runs process 0 as tests/engine/multihost_scenario.py (which drives the engine as the worker's
process 0 does, without Temporal) and process 1 as the real `tinkerflow jax-worker --process-id 1` follower.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tinkerflow.workers.engine import multihost
from tinkerflow.workers.engine.types import InputError, LoraConfig, SampleInput

SCENARIO = Path(__file__).with_name("multihost_scenario.py")
# float32 on CPU; with fsdp=2 across processes the batch rows and the hidden axis are split, so matmul and gradient
# sums are reduced (over gloo) in another order than on one device: each value may differ in its last few bits,
# amplified a little by two AdamW steps and the log-softmax. 1e-5 of each array's scale is ~100x that noise and far
# below any real bug (a wrong shard or a stale step moves values by >= 1e-2). Token ids must match exactly.
REL = 1e-5
# Except the trained weights: Adam divides each gradient element by its own running magnitude, so a weight moves by
# ~lr per step whatever its gradient's size, and an element whose gradient is tiny (a rare token's unembedding
# column, a sum that nearly cancels) carries the reordering noise of that gradient relative to itself, not to the
# array. Bound them by a thousandth of one optimizer step instead (seen: ~6e-5 of a step); a lost or doubled
# step, or a wrong shard, is off by a whole step.
WEIGHT_ATOL_STEPS = 1e-3
PROCESS_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------- fakes


class ListChannel:
    """One writer, any number of readers, in memory."""

    def __init__(self):
        self.messages: list[bytes] = []

    def reader(self) -> ListChannel.Reader:
        return ListChannel.Reader(self)

    def send(self, data: bytes) -> None:
        self.messages.append(data)

    class Reader:
        def __init__(self, channel: ListChannel):
            self.channel, self.n = channel, 0

        def receive(self, timeout_s: float) -> bytes | None:
            if self.n >= len(self.channel.messages):
                return None
            self.n += 1
            return self.channel.messages[self.n - 1]


@dataclass
class FakeInfo:
    arch: str = "qwen3"
    vocab_size: int = 300


class FakeEngine:
    """Records the calls it gets; same attributes `fingerprint` reads."""

    def __init__(self, rank_limit: int = 8):
        self.info = FakeInfo()
        self.max_lora_adapters, self.max_lora_rank, self.micro_batch_tokens = 4, rank_limit, 16384
        self.dtype = "float32"
        self.mesh = SimpleNamespace(shape={"fsdp": 2, "tp": 1},
                                    devices=np.array([SimpleNamespace(id=0), SimpleNamespace(id=1)]))  # fmt: skip
        self.tokenizer = lambda text: [1, 2, 3]  # callable, but not a method: read, never broadcast
        self.calls: list[tuple] = []
        self.sample_slots = 256

    def create_adapter(self, slot: int, config: LoraConfig) -> None:
        if config.rank > self.max_lora_rank:
            raise InputError("rank too large")
        self.calls.append(("create_adapter", slot, config))

    def sample(self, requests: list[SampleInput]) -> list[str]:
        self.calls.append(("sample", requests))
        return [f"sampled {r.seed}" for r in requests]


@dataclass
class FakeKV:
    """The coordination service's key-value calls the channel uses."""

    store: dict = field(default_factory=dict)

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.store, key
        self.store[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.store[key]

    def key_value_increment(self, key, n):
        self.store[key] = self.store.get(key, 0) + n
        return self.store[key]

    def key_value_delete(self, key):
        for k in [k for k in self.store if k == key or k.startswith(key + "/")]:
            del self.store[k]


# ---------------------------------------------------------------------------------------------- protocol


def test_followers_replay_the_leaders_calls_with_the_leaders_seeds():
    channel = ListChannel()
    leader, followers = FakeEngine(), [FakeEngine(), FakeEngine()]
    readers = [channel.reader() for _ in followers]
    driven = multihost.DrivenEngine(leader, channel)  # pyright: ignore[reportArgumentType] (test double)

    driven.create_adapter(0, LoraConfig(rank=4))  # no seed: the leader draws one for everybody
    driven.create_adapter(1, config=LoraConfig(rank=2, seed=7))
    with pytest.raises(InputError):  # the follower gets the same error and carries on
        driven.create_adapter(2, LoraConfig(rank=99))
    answer = driven.sample([SampleInput(prompt=np.array([1, 2], np.int32)),
                            SampleInput(prompt=np.array([3], np.int32), seed=5)])  # fmt: skip
    driven.sample_slots = 8
    assert driven.sample_slots == 8 and driven.info.vocab_size == 300 and driven.tokenizer("x") == [1, 2, 3]
    assert driven.max_lora_rank == 8
    driven.stop_followers()
    driven.stop_followers()  # idempotent
    with pytest.raises(RuntimeError, match="stop"):
        driven.create_adapter(3, LoraConfig(rank=1, seed=1))

    for follower, reader in zip(followers, readers):
        assert multihost.follow(follower, reader, poll_s=0) == 4  # pyright: ignore[reportArgumentType] (test double)
        assert repr(follower.calls) == repr(leader.calls) and follower.sample_slots == 8
    seed = leader.calls[0][2].seed
    assert isinstance(seed, int) and leader.calls[1][2].seed == 7
    seeds = [r.seed for r in leader.calls[2][1]]
    assert isinstance(seeds[0], int) and seeds[1] == 5 and answer == [f"sampled {s}" for s in seeds]


def test_the_leader_never_answers_from_a_group_that_lost_a_process():
    """A collective whose peer died fails on the leader: that is no fault of the request, and the group can run no
    step again, so the leader leaves (on_broken) instead of answering; any other engine error is answered."""

    class Broken(FakeEngine):
        def sample(self, requests):
            raise RuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer [127.0.0.1]:55721")

        def create_adapter(self, slot, config):
            raise ValueError("an engine bug")

    left = []
    driven = multihost.DrivenEngine(Broken(), ListChannel(), on_broken=lambda name, e: left.append(name))  # pyright: ignore[reportArgumentType] (test double)
    with pytest.raises(RuntimeError, match="Gloo"):
        driven.sample([SampleInput(prompt=np.array([1], np.int32), seed=1)])
    assert left == ["sample"]
    with pytest.raises(ValueError):
        driven.create_adapter(0, LoraConfig(rank=1, seed=1))
    assert left == ["sample"], "an ordinary engine error is answered, the process stays"


def test_a_follower_with_another_engine_refuses_to_follow():
    channel = ListChannel()
    reader = channel.reader()
    multihost.DrivenEngine(FakeEngine(rank_limit=8), channel)  # pyright: ignore[reportArgumentType] (test double)
    with pytest.raises(RuntimeError, match="differs from the leader"):
        multihost.follow(FakeEngine(rank_limit=16), reader, poll_s=0)  # pyright: ignore[reportArgumentType] (test double)


def test_a_follower_stops_on_its_own_event():
    import threading

    stop = threading.Event()
    stop.set()
    assert multihost.follow(FakeEngine(), ListChannel().reader(), stop=stop, poll_s=0) == 0  # pyright: ignore[reportArgumentType] (test double)


@pytest.mark.parametrize("command", [
    ("call", "_check_slot", (0,), {}),  # private engine attribute
    ("call", "max_lora_rank", (), {}),  # not a method
    ("eval", "create_adapter"),
])  # fmt: skip
def test_followers_refuse_what_the_leader_never_sends(command):
    channel = ListChannel()
    channel.send(multihost.dumps(command))
    with pytest.raises(RuntimeError):
        multihost.follow(FakeEngine(), channel.reader(), poll_s=0)  # pyright: ignore[reportArgumentType] (test double)


def test_commands_unpickle_only_engine_types_and_numpy():
    from pathlib import PurePosixPath

    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, SlotState

    ok = ("call", "x", (ForwardBackwardInput(slot=1, data=[Datum(np.arange(3, dtype=np.int32),
                                                                 {"weights": np.ones(3, np.float32)})],
                                             loss_fn="ppo", loss_fn_config={"clip": 0.2}),
                        SlotState(LoraConfig(2), {"a": np.zeros((2, 2))}, {}, {}, np.int64(3)), PurePosixPath("/x"),  # pyright: ignore[reportArgumentType] (test double)
                        {1, 2}, np.float32(1.5)), {})  # fmt: skip
    back = multihost.loads(multihost.dumps(ok))
    assert back[2][0].data[0].inputs["weights"].dtype == np.float32 and back[2][1].step == 3
    with pytest.raises(pickle.UnpicklingError, match=r"(os|posix)\.system"):
        multihost.loads(pickle.dumps(("call", "x", (os.system,), {})))
    with pytest.raises(pickle.UnpicklingError, match=r"subprocess\.Popen"):
        multihost.loads(pickle.dumps(subprocess.Popen))


@pytest.mark.parametrize("size", [10, 25_000])
def test_key_value_channel_orders_splits_and_cleans_up(monkeypatch, size):
    monkeypatch.setattr(multihost, "PART_BYTES", 4096)
    kv = FakeKV()
    writer = multihost.KeyValueChannel(kv, num_readers=2, prefix="p")
    readers = [multihost.KeyValueChannel(kv, num_readers=2, prefix="p") for _ in range(2)]
    assert readers[0].receive(0.01) is None
    payloads = [os.urandom(size), b"second"]
    for p in payloads:
        writer.send(p)
    assert [readers[0].receive(0.01) for _ in payloads] == payloads
    assert kv.store  # the second reader has not read yet
    assert [readers[1].receive(0.01) for _ in payloads] == payloads
    assert kv.store == {}, "the last reader deletes what it read"


def test_key_value_channel_raises_when_the_leader_is_gone():
    class Gone(FakeKV):
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")

    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        multihost.KeyValueChannel(Gone(), num_readers=1).receive(0.01)


@pytest.mark.parametrize("coordinator,n,pid,message", [
    ("127.0.0.1:1234", 1, 0, "num_processes must be >= 2"),
    ("127.0.0.1:1234", 2, 2, r"process_id 2 is not in \[0, 2\)"),
    ("", 2, 0, "host:port"),
])  # fmt: skip
def test_initialize_checks_its_arguments_before_touching_jax(coordinator, n, pid, message):
    with pytest.raises(ValueError, match=message):
        multihost.initialize(coordinator, n, pid)


# ---------------------------------------------------------------------------------------------- CLI


def test_jax_worker_multihost_flags(monkeypatch):
    from tinkerflow.cli.main import build_parser
    from tinkerflow.common.settings import Settings

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    help_text = sub.choices["jax-worker"].format_help()
    for flag in ("--coordinator-address", "--num-processes", "--process-id", "--mesh-fsdp", "--mesh-tp"):
        assert flag in help_text
        assert flag not in sub.choices["api"].format_help()  # the JAX worker's only
    args = parser.parse_args(["jax-worker", "--coordinator-address", "host-0.svc:8476", "--num-processes", "4",
                              "--process-id", "3", "--mesh-fsdp", "2", "--mesh-tp", "2"])  # fmt: skip
    s = Settings().with_args(args)
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("host-0.svc:8476", 4, 3)
    assert (s.mesh_fsdp, s.mesh_tp) == (2, 2)

    for name in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID", "MESH_FSDP", "MESH_TP"):
        monkeypatch.delenv("TINKERFLOW_" + name, raising=False)
    assert (Settings().num_processes, Settings().process_id, Settings().mesh_fsdp, Settings().mesh_tp) == (1, 0, 0, 1)
    monkeypatch.setenv("TINKERFLOW_COORDINATOR_ADDRESS", "w-0-0.tinkerflow-jax:8476")
    monkeypatch.setenv("TINKERFLOW_NUM_PROCESSES", "2")
    monkeypatch.setenv("TINKERFLOW_PROCESS_ID", "1")
    s = Settings().with_args(parser.parse_args(["jax-worker", "--process-id", "0"]))  # flags win over the env
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("w-0-0.tinkerflow-jax:8476", 2, 0)


# ---------------------------------------------------------------------------------------------- 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scenario_module():
    spec = importlib.util.spec_from_file_location("multihost_scenario", SCENARIO)
    module = importlib.util.module_from_spec(spec)  # pyright: ignore[reportArgumentType] (the file exists)
    spec.loader.exec_module(module)
    return module


def _start_two_processes(model_dir: Path, tmp_path: Path) -> tuple[list[subprocess.Popen], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKERFLOW_") and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")  # one CPU device per process
    coordinator = f"127.0.0.1:{_free_port()}"
    out = tmp_path / "leader.json"
    leader = [sys.executable, str(SCENARIO), str(model_dir), coordinator, str(out), "--mesh-fsdp", "2"]
    follower = [
        sys.executable,
        "-m",
        "tinkerflow.cli.main",
        "jax-worker",
        "--base-model",
        str(model_dir),
        "--max-lora-adapters",
        "4",
        "--max-lora-rank",
        "8",
        "--state-dir",
        str(tmp_path / "state"),
        "--coordinator-address",
        coordinator,
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--mesh-fsdp",
        "2",
        "--temporal-address",
        "127.0.0.1:1",
    ]  # fmt: skip  (never dialled)
    procs = []
    for n, cmd in enumerate((leader, follower)):
        with open(tmp_path / f"process{n}.log", "w") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, out


def _wait(procs: list[subprocess.Popen], tmp_path: Path) -> None:
    """Until both exit, one fails (then the other, which would wait for it, is killed) or the time is up."""
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    logs = "\n".join(f"--- process {n} (rc {p.returncode}) ---\n" + (tmp_path / f"process{n}.log").read_text()[-4000:]
                     for n, p in enumerate(procs))  # fmt: skip
    assert all(p.returncode == 0 for p in procs), logs


def _max_rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30)) if want.size else 0.0


@pytest.mark.timeout(PROCESS_TIMEOUT_S + 120)
def test_two_cpu_processes_train_and_sample_like_one(qwen3_dir, tmp_path, request):
    """Process 0 drives, process 1 (the real jax-worker CLI) follows: create_adapter, 2x (forward_backward +
    optim_step) over two adapters, the trained weights fetched across hosts, a rejected call, greedy and seeded
    sampling of a snapshot; the same as this process's 1-device engine. An adapter created without a seed comes out
    the same on both processes (the leader draws the seed)."""
    scenario = _scenario_module()
    t0 = time.perf_counter()
    procs, out = _start_two_processes(qwen3_dir, tmp_path)
    try:  # meanwhile, the 1-process reference on the session's engine (loaded now if no test did yet)
        engine = request.getfixturevalue("engine")
        assert (engine.max_lora_adapters, engine.max_lora_rank) == (scenario.MAX_ADAPTERS, scenario.MAX_RANK)
        want = json.loads(json.dumps(scenario.run(engine)))
    finally:
        _wait(procs, tmp_path)
    got = json.loads(out.read_text())
    elapsed = time.perf_counter() - t0

    assert got["process_count"] == 2 and got["mesh"] == {"fsdp": 2, "tp": 1}
    assert got["seedless_adapter_agrees"] is True
    assert got["rejected"] == want["rejected"] and "max_lora_rank" in got["rejected"]
    for name in ("greedy_tokens", "seeded_tokens"):
        assert got[name] == want[name], name
    diffs = {}
    for name in ("loss", "logprobs", "grad_norm", "greedy_logprobs", "prompt_logprobs", "seeded_logprobs"):
        diffs[name] = _max_rel(got[name], want[name])
    assert sorted(got["weights0"]) == sorted(want["weights0"])
    weights_diff = max(float(np.max(np.abs(np.subtract(got["weights0"][k], want["weights0"][k]))))
                       for k in want["weights0"]) / scenario.LEARNING_RATE  # fmt: skip
    print(f"\n2-process vs 1-process: max difference relative to each array's scale {json.dumps(diffs)}, "
          f"trained weights {weights_diff:.2e} of an optimizer step; leader timing {got['timing']}; "
          f"test {elapsed:.1f}s")  # fmt: skip
    for name, diff in diffs.items():
        assert diff <= REL, f"{name}: {diff:.2e} of its scale > {REL}"
    assert weights_diff <= WEIGHT_ATOL_STEPS, f"trained weights differ by {weights_diff:.2e} of an optimizer step"
