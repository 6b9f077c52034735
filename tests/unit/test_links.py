"""The link probe and the slow-link watch without Ray: real TCP handshakes on loopback,
and which rank a slow round trip names."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from shoal.launch.progress import EVENT_LINES
from shoal.messages import EventKind, WorkerValue
from shoal.worker.links import LINK_ADDRESS, NO_READING, LinkProbe, address_number, address_of, parse_address
from shoal.worker.metrics import StragglerWatch, worker_metrics


@pytest.fixture
def listener() -> Iterator[tuple[str, int]]:
    """A listening socket: the kernel completes handshakes without an accept()."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        yield server.getsockname()[:2]


def test_a_probe_times_real_handshakes_and_names_its_own_address(listener: tuple[str, int]) -> None:
    probe = LinkProbe(listener, every_s=60)
    probe.measure()
    assert 0 < probe.round_trip_s < 1.0
    assert probe.per_rank() == {
        WorkerValue.LINK_RTT_S: probe.round_trip_s,
        LINK_ADDRESS: float(int.from_bytes(socket.inet_aton("127.0.0.1"), "big")),
    }


def test_a_probe_on_its_thread_reads_and_stops(listener: tuple[str, int]) -> None:
    probe = LinkProbe(listener, every_s=0.05).start()
    try:
        for _ in range(200):  # bounded: 200 x 10 ms
            if probe.round_trip_s > 0:
                break
            time.sleep(0.01)
    finally:
        probe.stop()
    assert probe.round_trip_s > 0 and probe.address == "127.0.0.1"
    assert probe._thread is not None and not probe._thread.is_alive()


def test_an_unreachable_head_or_none_gives_no_reading_and_never_raises() -> None:
    with socket.socket() as closed:  # a port that was free a moment ago: refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    probe = LinkProbe(("127.0.0.1", port), every_s=60)
    probe.measure()
    assert probe.round_trip_s == NO_READING
    idle = LinkProbe(None, every_s=5).start()
    assert idle._thread is None and idle.per_rank() == {
        WorkerValue.LINK_RTT_S: NO_READING,
        LINK_ADDRESS: NO_READING,
    }
    idle.stop()


def test_addresses_travel_as_numbers() -> None:
    assert address_of(address_number("10.213.7.3")) == "10.213.7.3"
    assert address_number("::1") == NO_READING and address_of(NO_READING) is None
    assert parse_address("10.213.7.1:6379") == ("10.213.7.1", 6379)
    assert parse_address("[fd00::1]:6379") == ("fd00::1", 6379)


def test_the_rank_behind_a_slow_link_is_named_even_with_two_ranks() -> None:
    watch = StragglerWatch(factor=1.5, steps=3, min_gap_s=0.02, measure=WorkerValue.LINK_RTT_S)
    nodes = ["10.213.7.2", "10.213.7.3"]
    events = []
    for step, slow in enumerate([0.1, 0.11, 0.1, 0.1, 0.0004], start=1):
        events += watch.observe(step, [0.0003, slow], nodes)
    assert [(e["kind"], e["rank"], e.get("node"), e["step"]) for e in events] == [
        ("straggler", 1, "10.213.7.3", 3),
        ("straggler_recovered", 1, "10.213.7.3", 5),
    ]
    assert events[0]["cause"] == "link" and events[0]["link_rtt_s"] == 0.1 and events[0]["median_s"] == 0.0003
    line = EVENT_LINES[EventKind.STRAGGLER](events[0])
    assert "rank 1 on 10.213.7.3" in line and "100 ms a round trip" in line and "0.3 ms" in line


def test_one_slow_reading_seen_by_many_steps_is_not_a_streak() -> None:
    watch = StragglerWatch(factor=1.5, steps=3, min_gap_s=0.02, measure=WorkerValue.LINK_RTT_S)
    events = [e for step in range(1, 50) for e in watch.observe(step, [0.0003, 0.1])]  # one reading
    assert events == []
    events = [
        e for step, slow in enumerate([0.12, 0.11], start=50) for e in watch.observe(step, [0.0003, slow])
    ]
    assert [(e["kind"], e["step"]) for e in events] == [("straggler", 51)]  # the 3rd reading: 0.1, 0.12, 0.11


def test_round_trips_below_the_gap_or_without_a_reading_are_not_stragglers() -> None:
    watch = StragglerWatch(factor=1.5, steps=1, min_gap_s=0.02, measure=WorkerValue.LINK_RTT_S)
    assert watch.observe(1, [0.00005, 0.0005, 0.0004]) == []  # a rank on the head's node: 10x, 0.45 ms
    assert watch.observe(2, [NO_READING, 0.2]) == []  # nobody to compare with yet
    metrics = worker_metrics(
        {"busy_s": [0.1, 0.1], "peak_mb": [1.0, 1.0], "link_rtt_s": [NO_READING, 0.2]}, False
    )
    assert metrics["worker/1/link_rtt_s"] == 0.2 and "worker/0/link_rtt_s" not in metrics
