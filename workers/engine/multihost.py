"""Multi-host JAX worker: `jax.distributed`, and the leader/follower protocol that runs one engine over many hosts.

A model sharded over several hosts is ONE SPMD program: every process must enter the same jitted computations, in
the same order, with the same host inputs (the batch, the slot, the hyper-parameters), or the collectives inside
them never meet. Only process 0 (the leader) polls Temporal. It wraps its engine in a `DrivenEngine`, which
broadcasts each engine call to the others before making it; every other process (a follower) runs `follow`, which
replays those calls on its own engine in the same order. Answers come from the leader's copy only; a follower
drops its own (they are the same numbers, or the same InputError, since every engine holds the same state).

The command channel is the key-value store of the coordination service that `jax.distributed.initialize` already
runs in process 0 (`KeyValueChannel`), rather than a device broadcast (`multihost_utils.broadcast_one_to_all`) or
a TCP side channel of our own:

* an idle follower waits in an RPC with a deadline, in a loop, never inside a device collective: a worker may sit
  idle for hours, which gloo/NCCL collectives are not meant to survive (they time out or spin), and a dead leader
  shows up as a failed RPC (the coordination service lives in process 0) instead of a hang;
* a payload of any size costs no compile (a device broadcast compiles per shape) and no accelerator memory;
* no port beyond the coordinator's (`--coordinator-address`, already in the manifests), no address to agree on.

Commands are pickled with protocol 5 and unpickled by an allow-list (`_CommandUnpickler`: the engine's own types,
numpy arrays and scalars, pathlib paths), so whoever can reach the coordinator port still cannot make a follower
import or run anything else. Engine randomness is fixed on the leader before the broadcast: a `LoraConfig` or
`SampleInput` without a seed gets one there, so every process draws the same adapter init and the same samples.

Engine methods that fetch split arrays to the host do so through `DeviceLayout.to_host`, itself a computation over the
whole mesh: the followers take part because they replay the same call. So every public engine method, reads
included, is broadcast; plain attributes (`info`, `tokenizer`, ...) are read from the leader's engine.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import logging
import os
import pickle
import secrets
import threading
from typing import Any, Protocol

from . import types as engine_types
from .interface import EngineForwarder
from .types import (
    InputError,
    LoraConfig,
    SampleInput,
)

log = logging.getLogger(__name__)

KEY_PREFIX = "tinkerflow/engine"
# Commands larger than this go in parts (the coordination service takes 64 MiB values; stay well inside).
PART_BYTES = 4 << 20
POLL_S = 10.0  # how long one follower RPC waits for the next command before it looks at its stop event again
# What a cross-process collective raises when a peer process of the group is gone (gloo on CPU, NCCL on GPU, the
# coordination service everywhere). After one, this group can run no step again: see `DrivenEngine`.
BROKEN_GROUP_MARKERS = (
    "Gloo",
    "gloo",
    "NCCL",
    "Connection closed by peer",
    "Connection reset by peer",
    "coordination service",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
)
EXIT_BROKEN_GROUP = 70  # the exit status of a process 0 that left a broken group (EX_SOFTWARE)


def initialize(
    coordinator_address: str, num_processes: int, process_id: int, *, initialization_timeout_s: int = 300
) -> None:
    """Join `jax.distributed` (before any other JAX call in this process). On CPU, collectives across processes
    go through gloo (TCP), the default of jax 0.10; an explicit `jax_cpu_collectives_implementation` is kept."""
    if num_processes < 2:
        raise ValueError(f"num_processes must be >= 2 for a multi-host worker, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
    if not coordinator_address or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address must be host:port, got {coordinator_address!r}")
    import jax

    if not jax.config.jax_cpu_collectives_implementation:  # pyright: ignore[reportAttributeAccessIssue] (unstubbed flag)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout_s,
    )
    log.info(
        "jax.distributed: process %d of %d (coordinator %s), %d local / %d global devices (%s)",
        process_id,
        num_processes,
        coordinator_address,
        jax.local_device_count(),
        jax.device_count(),
        jax.default_backend(),
    )


# ---------------------------------------------------------------------------------------------- the channel


class Channel(Protocol):
    def send(self, data: bytes) -> None: ...

    def receive(self, timeout_s: float) -> bytes | None:
        """The next command, or None when none came within timeout_s."""


class KeyValueChannel:
    """Commands in order through the coordination service's key-value store (one writer, N-1 readers).

    Command n is the key `<prefix>/<n>`: its bytes after a one-byte tag, "I" (inline) or "P" (the number of parts,
    stored at `<prefix>/<n>/<i>`, written before the key itself). Each reader counts itself at `<prefix>/<n>/read`;
    the last one deletes the command's keys, so the store does not grow with the number of calls.
    """

    def __init__(self, client: Any = None, *, num_readers: int | None = None, prefix: str = KEY_PREFIX):
        if client is None:
            import jax
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise RuntimeError("jax.distributed is not initialized")
            num_readers = jax.process_count() - 1 if num_readers is None else num_readers
        self._client = client
        self._readers = num_readers if num_readers is not None else 1
        self._prefix = prefix
        self._seq = 0

    def send(self, data: bytes) -> None:
        key = f"{self._prefix}/{self._seq}"
        if len(data) <= PART_BYTES:
            self._client.key_value_set_bytes(key, b"I" + data)
        else:
            parts = range(0, len(data), PART_BYTES)
            for i, start in enumerate(parts):
                self._client.key_value_set_bytes(f"{key}/{i}", data[start : start + PART_BYTES])
            self._client.key_value_set_bytes(key, b"P" + str(len(parts)).encode())
        self._seq += 1

    def receive(self, timeout_s: float) -> bytes | None:
        key = f"{self._prefix}/{self._seq}"
        try:
            head = self._client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except Exception as e:  # jax.errors.JaxRuntimeError; anything but a deadline means the leader is gone
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            raise
        if head[:1] == b"I":
            data = head[1:]
        else:
            data = b"".join(
                self._client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000) for i in range(int(head[1:]))
            )
        if self._client.key_value_increment(f"{key}/read", 1) >= self._readers:
            self._client.key_value_delete(key)
        self._seq += 1
        return data


# ---------------------------------------------------------------------------------------------- commands


_ALLOWED_NUMPY = {"ndarray", "dtype", "_reconstruct", "_frombuffer", "scalar"}
_ALLOWED_BUILTINS = {"complex", "set", "frozenset", "slice", "range", "bytearray"}
_ALLOWED_PATHLIB = {"Path", "PosixPath", "PurePath", "PurePosixPath"}


class _CommandUnpickler(pickle.Unpickler):
    """Only what engine calls take: the engine's types, numpy arrays and scalars, pathlib paths, builtins."""

    def find_class(self, module: str, name: str) -> Any:
        numpy = module == "numpy" or module.startswith("numpy.")
        value = None if name.startswith("_") else getattr(engine_types, name, None)
        # the engine's types, and those it takes from the common floor under their own module (ProcessedImage)
        if isinstance(value, type) and module in (engine_types.__name__, value.__module__):
            return value
        if (
            (numpy and (name in _ALLOWED_NUMPY or module == "numpy.dtypes"))
            or (module == "builtins" and name in _ALLOWED_BUILTINS)
            or (module == "pathlib" and name in _ALLOWED_PATHLIB)
            or (module, name) == ("collections", "OrderedDict")
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"engine command refers to {module}.{name}, which is not allowed")


def dumps(command: tuple) -> bytes:
    return pickle.dumps(command, protocol=5)


def loads(data: bytes) -> tuple:
    return _CommandUnpickler(io.BytesIO(data)).load()


def fingerprint(engine: Any) -> dict:
    """What must be equal on every process for them to compile and run the same programs."""
    return {
        "model": dataclasses.asdict(engine.info),
        "max_lora_adapters": engine.max_lora_adapters,
        "max_lora_rank": engine.max_lora_rank,
        "micro_batch_tokens": engine.micro_batch_tokens,
        "decode_layers": engine.decode_layers,
        "dtype": str(engine.dtype),
        "mesh": dict(engine.mesh.shape),
        "devices": [int(d.id) for d in engine.mesh.devices.flat],
    }


def _with_seeds(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Draw the seeds the engine would draw itself (secrets) here, once, so every process uses the same."""

    def fill(value: Any) -> Any:
        if name == "create_adapter" and isinstance(value, LoraConfig) and value.seed is None:
            return dataclasses.replace(value, seed=secrets.randbits(63))
        if name == "sample" and isinstance(value, list):
            return [
                dataclasses.replace(r, seed=secrets.randbits(64))
                if isinstance(r, SampleInput) and r.seed is None
                else r
                for r in value
            ]
        return value

    return tuple(fill(a) for a in args), {k: fill(v) for k, v in kwargs.items()}


# ---------------------------------------------------------------------------------------------- leader / follower


class DrivenEngine(EngineForwarder):
    """Process 0's engine: every public method call (and attribute write) is first sent to the followers, then made
    here; its answer is this process's. Same interface as the Engine (`interface.EngineApi`, through `EngineForwarder`;
    any other public method, the warm-up's and the tests', goes through `__getattr__`), so
    `EngineActivities(engine=DrivenEngine(...))` needs no change. Plain attributes are read from the wrapped engine.
    Calls are serialised by a lock, so the order the followers replay is the order they ran here.

    A call that fails because a peer process is gone (`BROKEN_GROUP_MARKERS`) is not answered: the group can never
    run a step again and its error is no fault of the request, so the process leaves (`on_broken`, by default exit
    with EXIT_BROKEN_GROUP). Its activity then times out like any dead worker's, and whatever restarts the group
    (Ray through `tinkerflow ray`, a JobSet) brings it back; the runs it held are restored from their snapshots."""

    def __init__(self, engine: Any, channel: Channel | None = None, on_broken: Any = None):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_channel", channel if channel is not None else KeyValueChannel())
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_stopped", False)
        object.__setattr__(self, "_on_broken", on_broken if on_broken is not None else _leave_broken_group)
        self._send(("hello", fingerprint(engine)))

    @property
    def engine(self) -> Any:
        """The wrapped engine, for what must not be broadcast (nothing in the activities)."""
        return self._engine

    def _inner(self) -> Any:
        return self._engine

    def _send(self, command: tuple) -> None:
        if self._stopped:
            raise RuntimeError("the followers were told to stop; this engine can no longer be driven")
        self._channel.send(dumps(command))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if name.startswith("_") or not inspect.ismethod(value):
            return value

        @functools.wraps(value)
        def driven(*args, **kwargs):
            return self._forward(name, args, kwargs)

        return driven

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"{name} is private to the engine")
        with self._lock:
            self._send(("set", name, value))
            setattr(self._engine, name, value)

    def _forward(self, name: str, args: tuple, kwargs: dict) -> Any:
        args, kwargs = _with_seeds(name, args, kwargs)
        with self._lock:
            self._send(("call", name, args, kwargs))
            try:
                return getattr(self._engine, name)(*args, **kwargs)
            except InputError:
                raise
            except Exception as e:
                if any(marker in str(e) for marker in BROKEN_GROUP_MARKERS):
                    self._on_broken(name, e)
                raise

    def stop_followers(self) -> None:
        """Tell every follower to return from `follow` (idempotent); the engine is no longer driven after this."""
        with self._lock:
            if not self._stopped:
                self._send(("stop",))
                object.__setattr__(self, "_stopped", True)


def _leave_broken_group(name: str, error: Exception) -> None:
    log.critical(
        "engine call %s failed because a process of the group is gone (%s); leaving the group so that it "
        "is restarted whole",
        name,
        str(error)[:300],
    )
    logging.shutdown()
    os._exit(EXIT_BROKEN_GROUP)


def follow(
    engine: Any, channel: Channel | None = None, stop: threading.Event | None = None, poll_s: float = POLL_S
) -> int:
    """A follower's loop: replay the leader's engine calls on `engine` until the leader says stop (or `stop` is
    set). Returns the number of calls replayed. An exception from a replayed call is the leader's too (same state,
    same inputs) and is logged, not raised; a channel failure (the leader is gone) is raised."""
    channel = channel if channel is not None else KeyValueChannel()
    calls = 0
    while stop is None or not stop.is_set():
        data = channel.receive(poll_s)
        if data is None:
            continue
        command = loads(data)
        kind = command[0]
        if kind == "stop":
            log.info("follower: the leader said stop after %d calls", calls)
            return calls
        if kind == "hello":
            mine = fingerprint(engine)
            if command[1] != mine:
                raise RuntimeError(f"this process's engine differs from the leader's: {mine} != {command[1]}")
            log.info("follower: in step with the leader (%s)", mine["mesh"])
            continue
        name = command[1]
        if name.startswith("_"):
            raise RuntimeError(f"refusing private engine attribute {name!r}")
        if kind == "set":
            setattr(engine, name, command[2])
            continue
        if kind != "call":
            raise RuntimeError(f"unknown engine command {kind!r}")
        method = getattr(engine, name)
        if not inspect.ismethod(method):
            raise RuntimeError(f"{name!r} is not an engine method")
        calls += 1
        try:
            method(*command[2], **command[3])
        except Exception as e:  # noqa: BLE001 — the leader got the same and answers it
            log.log(
                logging.DEBUG if isinstance(e, InputError) else logging.WARNING,
                "follower: %s raised %s: %s",
                name,
                type(e).__name__,
                e,
            )
    return calls
