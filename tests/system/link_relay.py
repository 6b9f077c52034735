"""A network link with loss and delay, made of two TAP devices and this process between them.

This machine's kernel has no `sch_netem` (and no tc actions or netfilter tools), so a link
that loses or delays packets is made in user space: started inside a node's namespace, it
makes the TAP device `eth0` there and a second one that it moves into the hub namespace as
the bridge port `PORT`, then copies every Ethernet frame from one to the other, dropping a
share of them and holding each for a delay drawn from N(delay, jitter) (first in, first
out per direction). The kernel's TCP on both ends sees real loss and latency. The shaping
is read from the JSON file SETTINGS ({"loss": 0.2, "delay_ms": 50, "jitter_ms": 10}),
which may change while it runs; what it did so far is in SETTINGS with the suffix
`.stats` ({"frames": N, "dropped": M}). The links vanish when this process ends.

    python link_relay.py HUB_NAMESPACE PORT SETTINGS
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
READ_SETTINGS_EVERY_S = 0.2


def tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def shaping(path: Path) -> dict[str, float]:
    try:
        return {"loss": 0.0, "delay_ms": 0.0, "jitter_ms": 0.0, **json.loads(path.read_text())}
    except (OSError, ValueError):
        return {"loss": 0.0, "delay_ms": 0.0, "jitter_ms": 0.0}


def relay(ends: tuple[int, int], settings_path: Path) -> None:
    settings, read_at = shaping(settings_path), time.monotonic()
    counts = {"frames": 0, "dropped": 0}  # written next to the settings: what the link did
    stats = settings_path.with_suffix(".stats")
    held: dict[int, deque[tuple[float, bytes]]] = {ends[0]: deque(), ends[1]: deque()}  # by destination
    other = {ends[0]: ends[1], ends[1]: ends[0]}
    while True:
        now = time.monotonic()
        if now - read_at > READ_SETTINGS_EVERY_S:
            settings, read_at = shaping(settings_path), now
            stats.write_text(json.dumps(counts))
        due = [queue[0][0] for queue in held.values() if queue]
        timeout = max(0.0, min(due) - now) if due else READ_SETTINGS_EVERY_S
        readable, _, _ = select.select(list(ends), [], [], min(timeout, READ_SETTINGS_EVERY_S))
        now = time.monotonic()
        for source in readable:
            try:
                frame = os.read(source, 65536)
            except BlockingIOError:
                continue
            counts["frames"] += 1
            if random.random() < settings["loss"]:
                counts["dropped"] += 1
                continue
            delay = max(0.0, random.gauss(settings["delay_ms"], settings["jitter_ms"])) / 1000
            queue = held[other[source]]
            at = max(now + delay, queue[-1][0] if queue else 0.0)  # no reordering
            queue.append((at, frame))
        for destination, queue in held.items():
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                with contextlib.suppress(OSError):  # the link is down: lost, as on a cable
                    os.write(destination, frame)


def main() -> None:
    hub, port, settings = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    inner, outer = tap("eth0"), tap(port)
    subprocess.run(["ip", "link", "set", port, "netns", hub], check=True)
    print("ready", flush=True)
    relay((inner, outer), settings)


if __name__ == "__main__":
    main()
