# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""Multi-host JAX worker: the leader/follower protocol (in-process, with fake engines and a fake key-value store) and
the CLI flags. 2 real CPU processes joined by jax.distributed are test_multihost_processes.py.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from tinkerflow.workers.engine import multihost
from tinkerflow.workers.engine.types import InputError, LoraConfig, SampleInput

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
        self.decode_layers = "scan"
        self.dtype = "float32"
        self.mesh = SimpleNamespace(
            shape={"fsdp": 2, "tp": 1}, devices=np.array([SimpleNamespace(id=0), SimpleNamespace(id=1)])
        )
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
    answer = driven.sample(
        [SampleInput(prompt=np.array([1, 2], np.int32)), SampleInput(prompt=np.array([3], np.int32), seed=5)]
    )
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


@pytest.mark.parametrize(
    "command",
    [
        ("call", "_check_slot", (0,), {}),  # private engine attribute
        ("call", "max_lora_rank", (), {}),  # not a method
        ("eval", "create_adapter"),
    ],
)
def test_followers_refuse_what_the_leader_never_sends(command):
    channel = ListChannel()
    channel.send(multihost.dumps(command))
    with pytest.raises(RuntimeError):
        multihost.follow(FakeEngine(), channel.reader(), poll_s=0)  # pyright: ignore[reportArgumentType] (test double)


def test_commands_unpickle_only_engine_types_and_numpy():
    from pathlib import PurePosixPath

    from tinkerflow.common.images import ProcessedImage
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, SlotState

    ok = (
        "call",
        "x",
        (
            ForwardBackwardInput(
                slot=1,
                data=[
                    Datum(
                        np.arange(3, dtype=np.int32),
                        {"weights": np.ones(3, np.float32)},
                        images=(ProcessedImage(np.zeros((4, 6), np.float32), (1, 2, 2), 2),),
                    )
                ],
                loss_fn="ppo",
                loss_fn_config={"clip": 0.2},
            ),
            SlotState(LoraConfig(2), {"a": np.zeros((2, 2))}, {}, {}, np.int64(3)),  # pyright: ignore[reportArgumentType] (test double)
            PurePosixPath("/x"),
            {1, 2},
            np.float32(1.5),
        ),
        {},
    )
    back = multihost.loads(multihost.dumps(ok))
    assert back[2][0].data[0].inputs["weights"].dtype == np.float32 and back[2][1].step == 3
    assert back[2][0].data[0].images[0].grid == (1, 2, 2)  # a datum's images reach every host
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


@pytest.mark.parametrize(
    "coordinator,n,pid,message",
    [
        ("127.0.0.1:1234", 1, 0, "num_processes must be >= 2"),
        ("127.0.0.1:1234", 2, 2, r"process_id 2 is not in \[0, 2\)"),
        ("", 2, 0, "host:port"),
    ],
)
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
    args = parser.parse_args(
        [
            "jax-worker",
            "--coordinator-address",
            "host-0.svc:8476",
            "--num-processes",
            "4",
            "--process-id",
            "3",
            "--mesh-fsdp",
            "2",
            "--mesh-tp",
            "2",
        ]
    )
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
