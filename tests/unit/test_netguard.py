"""The test network guard (tests/netguard) refuses connections off this machine, in this
process and in every process the tests start, and lets local ones through."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NETGUARD_LOG

OFF_MACHINE = ("198.51.100.1", 443)  # TEST-NET-2 (RFC 5737): documentation only, never routed


@pytest.fixture
def forget_refusals() -> None:
    """These tests cause refusals on purpose: take them out of the log afterwards."""
    size = NETGUARD_LOG.stat().st_size
    yield
    with NETGUARD_LOG.open("r+") as log:
        log.truncate(size)


def test_a_connection_off_the_machine_is_refused_and_recorded(forget_refusals: None) -> None:
    size = NETGUARD_LOG.stat().st_size
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError, match="test network guard"):
        sock.connect(OFF_MACHINE)
    assert "198.51.100.1" in NETGUARD_LOG.read_text()[size:]


def test_a_child_process_is_guarded_too(forget_refusals: None) -> None:
    code = f"import socket; socket.create_connection({OFF_MACHINE!r}, timeout=5)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "refused by the test network guard" in done.stderr


def test_loopback_connections_go_through(tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5) as client:
            accepted, _ = server.accept()
            client.sendall(b"ok")
            assert accepted.recv(2) == b"ok"
            accepted.close()


def test_the_cloud_metadata_service_is_refused_without_failing_the_test() -> None:
    """Ray's dashboard asks it on every start (tests/netguard/shoal_netguard.py REFUSED_QUIETLY)."""
    size = NETGUARD_LOG.stat().st_size
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError, match="test network guard"):
        sock.connect(("169.254.169.254", 80))
    assert NETGUARD_LOG.stat().st_size == size
