"""`tinkerflow ray` without a Ray cluster: the flags, the placement group's bundles, and each process's place in the
jax.distributed group as the multi-host worker expects it."""

from __future__ import annotations

import argparse

import pytest

from tinkerflow.cli import ray_plan
from tinkerflow.cli.main import build_parser
from tinkerflow.common.settings import Settings


def _settings(argv: list[str]) -> Settings:
    return Settings().with_args(build_parser().parse_args(["ray", *argv]))


def test_help_names_every_placement_flag():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["ray"].format_help()
    for flag in (
        "--ray-address",
        "--hosts",
        "--cpus-per-host",
        "--gpus-per-host",
        "--tpus-per-host",
        "--strategy",
        "--max-restarts",
        "--mesh-fsdp",
        "--mesh-tp",
        "--with-stack",
        "--temporal-address",
        "--base-model",
    ):
        assert flag in text, flag


def test_flags_win_over_env_and_shape_the_group(monkeypatch):
    monkeypatch.setenv("TINKERFLOW_RAY_HOSTS", "8")
    monkeypatch.setenv("TINKERFLOW_RAY_TPUS_PER_HOST", "4")
    assert ray_plan.plan(Settings()).bundles == [{"CPU": 1.0, "TPU": 4.0}] * 8
    s = _settings(
        [
            "--hosts",
            "4",
            "--cpus-per-host",
            "4",
            "--mesh-fsdp",
            "16",
            "--strategy",
            "SPREAD",
            "--max-restarts",
            "-1",
            "--pool",
            "v6e",
        ]
    )
    group = ray_plan.plan(s)
    assert group.bundles == [{"CPU": 4.0, "TPU": 4.0}] * 4 and group.strategy == "SPREAD"
    opts = group.actor_options()
    assert opts["num_cpus"] == 4 and opts["num_gpus"] == 0 and opts["resources"] == {"TPU": 4.0}
    assert opts["max_restarts"] == -1 and opts["max_concurrency"] > 1  # `stop` is answered while `serve` runs
    assert group.worker_id == "ray-v6e"
    assert "JAX_PLATFORMS" not in ray_plan.actor_env(s, group)  # TPU hosts: JAX finds its own platform


def test_each_process_gets_its_bundle_index_and_actor_0s_coordinator(tmp_path):
    s = _settings(["--hosts", "2", "--mesh-fsdp", "2", "--state-dir", str(tmp_path), "--metrics-port", "9400"])
    group = ray_plan.plan(s)
    assert group.bundles == [{"CPU": 1.0}, {"CPU": 1.0}] and group.strategy == "STRICT_SPREAD"
    assert ray_plan.actor_env(s, group)["JAX_PLATFORMS"] == "cpu"
    per = [ray_plan.process_settings(s, group, i, "10.0.0.5:4321") for i in range(2)]
    assert [(p.process_id, p.num_processes, p.coordinator_address) for p in per] == [
        (0, 2, "10.0.0.5:4321"),
        (1, 2, "10.0.0.5:4321"),
    ]
    assert all((p.mesh_fsdp, p.mesh_tp) == (2, 1) for p in per)
    # a host other than the driver's resolves nothing against its own state dir
    assert per[1].store_url == (tmp_path / "store").as_uri()
    assert per[1].checkpoint_root == (tmp_path / "checkpoints").as_uri()
    assert (per[0].metrics_port, per[1].metrics_port) == (9400, 0)  # only the process that serves metrics
    one = ray_plan.process_settings(s, ray_plan.plan(_settings(["--state-dir", str(tmp_path)])), 0, "")
    assert (one.num_processes, one.coordinator_address) == (1, "")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hosts", "0"], "--hosts"),
        (["--cpus-per-host", "-1"], "--cpus-per-host"),
        (["--gpus-per-host", "8", "--tpus-per-host", "4"], "GPUs or TPUs"),
        (["--max-restarts", "-2"], "--max-restarts"),
    ],
)
def test_bad_placement_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        ray_plan.plan(_settings(argv))


def test_ray_command_needs_no_ray_to_parse_and_refuses_bad_flags_before_joining(capsys):
    from tinkerflow.cli.main import main

    assert main(["ray", "--hosts", "0"]) == 2  # refused before `import ray`


def test_a_lost_node_is_reported_as_such_and_the_restart_budget_is_kept(tmp_path):
    """RayGroup's fault reports without a cluster: a dead actor on a dead node names the host and what happens next;
    one on a live node names its pid; past --max-restarts re-forms the driver gives up with a clear message."""
    import threading
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from tinkerflow.cli.ray_actor import Whereabouts
    from tinkerflow.cli.ray_group import RayGroup

    group = RayGroup.__new__(RayGroup)
    nodes = [{"NodeID": "a" * 56, "Alive": True}, {"NodeID": "b" * 56, "Alive": False}]
    group.ray = SimpleNamespace(nodes=lambda: nodes)  # pyright: ignore[reportAttributeAccessIssue] (test double)
    group.group = ray_plan.plan(_settings(["--hosts", "2", "--max-restarts", "1", "--state-dir", str(tmp_path)]))
    group.where = [Whereabouts(0, 100, "10.0.0.1", "a" * 56), Whereabouts(1, 200, "10.0.0.2", "b" * 56)]
    group.stop, group.serving = threading.Event(), {}

    lost = group._death(1, RuntimeError("ActorDiedError: the actor died unexpectedly"))
    assert "host 10.0.0.2" in lost and "is lost" in lost and "re-places its bundle {'CPU': 1.0}" in lost
    died = group._death(0, RuntimeError("ActorDiedError: the actor died unexpectedly\nmore"))
    assert "pid 100 on 10.0.0.1" in died and "more" not in died

    group.generation = 2  # formed, then re-formed once: the one restart --max-restarts 1 allows is spent
    with pytest.raises(RuntimeError, match="--max-restarts"):
        group.reform({1: lost})


def test_an_address_where_no_ray_answers_fails_at_once_with_the_flag(tmp_path, capfd):
    pytest.importorskip("ray")
    from tinkerflow.cli.launch import free_port
    from tinkerflow.cli.main import main

    assert main(["ray", "--ray-address", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path)]) == 1
    assert "--ray-address" in capfd.readouterr().err
