"""The declared engine interface (`EngineApi`): what the activities call, which `Engine` implements and
`EngineForwarder` passes on with the same signatures, for the multi-host `DrivenEngine` and the JAX worker's
`EngineLock`, which forward through it and nowhere else."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from tinkerflow.workers.engine import multihost
from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.engine_lock import EngineLock
from tinkerflow.workers.engine.interface import EngineApi, EngineForwarder
from tinkerflow.workers.engine.types import ModelInfo

REPO = Path(__file__).resolve().parents[2]
# The modules that hold an engine and call it, and the names they call it by.
ACTIVITY_MODULES = [REPO / "activities" / "engine_activities.py", REPO / "activities" / "checkpoint_io.py"]


def _api_methods() -> list[str]:
    return sorted(n for n, v in vars(EngineApi).items() if inspect.isfunction(v) and not n.startswith("_"))


def _shape(fn) -> tuple:
    """A method's parameters (name, kind, default) and resolved type hints, `self` left out."""
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default) for p in list(sig.parameters.values())[1:]]
    return params, typing.get_type_hints(fn)


class _Sink:
    """A channel to no follower: the driven engine only sends."""

    def send(self, data: bytes) -> None:
        pass

    def receive(self, timeout_s: float) -> bytes | None:
        return None


def test_the_interface_names_the_methods_the_activities_call():
    assert _api_methods() == [
        "create_adapter",
        "drop_snapshot",
        "export_slot",
        "forward_backward",
        "free_adapter",
        "import_slot",
        "load_snapshot",
        "optim_step",
        "page",
        "sample",
        "snapshot",
        "snapshot_evicted",
    ]
    called: set[str] = set()
    for path in ACTIVITY_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            # engine.<name> and self.engine.<name>
            if isinstance(node, ast.Attribute):
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "engine"
                ):
                    called.add(node.attr)
    assert called, "no engine call found: did the activities move?"
    assert called <= set(_api_methods()) | {"info"}, f"activities call engine members outside EngineApi: {called}"


@pytest.mark.parametrize("cls", [Engine, EngineForwarder])
def test_engine_and_the_forwarder_declare_every_method_with_the_interfaces_signature(cls):
    for name in _api_methods():
        assert name in vars(cls), f"{cls.__name__}.{name} is not declared (a __getattr__ does not count)"
        assert _shape(getattr(cls, name)) == _shape(getattr(EngineApi, name)), f"{cls.__name__}.{name}"


def test_the_forwarder_reads_info_from_the_wrapped_engine():
    info = vars(EngineForwarder)["info"]
    assert isinstance(info, property) and typing.get_type_hints(info.fget)["return"] is ModelInfo


@pytest.mark.parametrize("wrapper", [multihost.DrivenEngine, EngineLock])
def test_each_wrapper_forwards_through_the_forwarder_alone(wrapper):
    assert issubclass(wrapper, EngineForwarder)
    assert not set(vars(wrapper)) & (set(_api_methods()) | {"info"}), f"{wrapper.__name__} spells a call out again"
    assert "_forward" in vars(wrapper) and "_inner" in vars(wrapper)


def test_a_loaded_engine_and_its_driven_wrapper_are_engine_apis(engine):
    assert isinstance(engine, EngineApi) and isinstance(engine.info, ModelInfo)
    driven = multihost.DrivenEngine(engine, _Sink())
    assert isinstance(driven, EngineApi) and driven.info is engine.info
    locked = EngineLock(driven)
    assert isinstance(locked, EngineApi) and locked.info is engine.info
    assert not isinstance(object(), EngineApi)
