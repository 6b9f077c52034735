"""Ray's worker processes run under the test network guard too (tests/netguard)."""

from __future__ import annotations

import socket

from tests.conftest import NETGUARD_LOG
from tests.unit.test_netguard import OFF_MACHINE


def _try_to_leave(address: tuple[str, int]) -> str:
    try:
        socket.create_connection(address, timeout=5).close()
    except ConnectionRefusedError as exc:
        return str(exc)
    return "connected"


def test_a_ray_worker_cannot_leave_the_machine(ray_cluster: str) -> None:
    import ray

    size = NETGUARD_LOG.stat().st_size
    try:
        answer = ray.get(ray.remote(_try_to_leave).remote(OFF_MACHINE), timeout=120)
        assert "refused by the test network guard" in answer
    finally:
        with NETGUARD_LOG.open("r+") as log:
            log.truncate(size)
