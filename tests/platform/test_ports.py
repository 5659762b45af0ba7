"""Ports for the parts `up` starts: chosen where the kernel and Ray never hand them out on their own
(launch.free_port), and a part is ready when it listens on its port itself (up.listens), never because someone else
took that port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tinkerflow.cli import up
from tinkerflow.cli.launch import FIRST_PORT, ephemeral_range, free_port
from tinkerflow.cli.up import Stack, listens
from tinkerflow.common.settings import Settings


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if low <= p <= high or p < FIRST_PORT]  # nor among Ray's worker ports
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_listens_names_the_process_that_holds_the_port(tmp_path):
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", free_port()))
        mine.listen()
        assert listens(os.getpid(), mine.getsockname()[1])
    port = free_port()
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); "
            "print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == b"up"
        assert listens(other.pid, port)
        assert not listens(os.getpid(), port)  # open, but not ours
    finally:
        other.kill()
        other.wait()
    assert not listens(other.pid, port)  # gone


def test_temporal_that_cannot_bind_its_port_fails_its_start_with_its_log(tmp_path, monkeypatch):
    """Another process takes the port between `up`'s check that it is free and Temporal's bind: the open port is not
    taken for a Temporal that is ready; Temporal's own failure is reported, with its log."""
    port = free_port()
    monkeypatch.setattr(up, "_port_open", lambda _address: False)  # it was free when `up` looked
    stack = Stack(Settings(state_dir=tmp_path / "state", temporal_address=f"127.0.0.1:{port}"))
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", port))
        thief.listen()
        try:
            with pytest.raises(RuntimeError, match=r"(?s)temporal exited with .*address already in use"):
                stack.start_temporal(port, 0, headless=True)
        finally:
            stack.stop()
