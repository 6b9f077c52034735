"""How long each worker's network link takes: a straggler behind a slow link.

A slow link slows every rank's collectives alike (the fast ranks wait for the slow one
inside the all-reduce), so busy times cannot tell which rank is behind it. A round trip
from each rank to one point outside the training group can: every rank times TCP
handshakes to the cluster's head (Ray's GCS port) on a background thread, and the
step's all-reduce gathers the latest median with the rank's own address. The rank whose
round trip stands out is behind the slow link, with any number of ranks, two included.
"""

from __future__ import annotations

import ipaddress
import socket
import statistics
import threading
import time

from shoal.messages import WorkerValue

LINK_ADDRESS = "link_address"  # the rank's own address on the probed path, as a number
NO_READING = -1.0  # a rank that has no round trip yet (or no head to time) in the gather
HANDSHAKES = 5  # per reading: the median of these
CONNECT_TIMEOUT_S = 2.0


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets) -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def address_number(address: str) -> float:
    """An IPv4 address as a number (exact in a float64 slot of the step's all-reduce);
    NO_READING for anything else."""
    try:
        return float(int(ipaddress.IPv4Address(address)))
    except ValueError:
        return NO_READING


def address_of(number: float) -> str | None:
    return str(ipaddress.IPv4Address(int(number))) if number >= 0 else None


def handshake_s(target: tuple[str, int]) -> tuple[float, str]:
    """One TCP handshake's round trip to `target`, and this end's address on that path."""
    started = time.perf_counter()
    with socket.create_connection(target, timeout=CONNECT_TIMEOUT_S) as connection:
        elapsed = time.perf_counter() - started
        return elapsed, connection.getsockname()[0]


class LinkProbe:
    """Times this rank's link to `target` every `every_s` seconds on a daemon thread.

    `round_trip_s` and `address` are the latest reading (NO_READING / "" before the first,
    or while the target cannot be reached): a probe never raises into training.
    """

    def __init__(self, target: tuple[str, int] | None, every_s: float):
        self.target, self.every_s = target, every_s
        self.round_trip_s, self.address = NO_READING, ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LinkProbe:
        if self.target is not None and self.every_s > 0:
            self._thread = threading.Thread(target=self._run, name="shoal-link-probe", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HANDSHAKES * CONNECT_TIMEOUT_S + 1)

    def measure(self) -> None:
        """One reading: the median of a few handshakes (the first may pay for ARP or a
        route lookup); unreachable: no reading."""
        assert self.target is not None
        try:
            samples = [handshake_s(self.target) for _ in range(HANDSHAKES)]
        except OSError:
            self.round_trip_s = NO_READING
            return
        self.round_trip_s = statistics.median(seconds for seconds, _ in samples)
        self.address = samples[-1][1]

    def per_rank(self) -> dict[str, float]:
        """This rank's slots in the step's all-reduce."""
        return {WorkerValue.LINK_RTT_S: self.round_trip_s, LINK_ADDRESS: address_number(self.address)}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.measure()
            self._stop.wait(self.every_s)
