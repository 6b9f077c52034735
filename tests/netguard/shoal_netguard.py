"""Refuse, and record, every TCP connection that leaves this machine.

Installed in the test process by tests/conftest.py and in every Python process
the tests start (shoal CLIs, Ray's workers, an MLflow server) through this
folder's `sitecustomize.py`, which Python imports at start-up from PYTHONPATH.
A refused attempt raises ConnectionRefusedError and is also appended to the file
$SHOAL_NETGUARD_LOG, so that a library that swallows the error and retries
(a hub client, a telemetry ping) still fails the test that caused it.

Local is loopback, the machine's own interface addresses and Unix sockets, and the
networks named in $SHOAL_NETGUARD_LINKS (comma-separated CIDRs): those of the veth links
a network test creates between network namespaces of its own, where they exist only.
UDP is not guarded: a UDP `connect` sends nothing (Ray uses one to learn its
own address), and name lookups are not connections.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from typing import Any

ENV_LOG = "SHOAL_NETGUARD_LOG"
ENV_LINKS = "SHOAL_NETGUARD_LINKS"
# Refused like any other, but not held against the test: Ray's dashboard asks the cloud
# metadata service which cloud it runs on every time it starts, whatever usage-stats setting
# (ray/dashboard/modules/usage_stats/usage_stats_head.py, run()), and copes with no answer.
REFUSED_QUIETLY = {("169.254.169.254", 80)}
_original_connect = socket.socket.connect
_original_connect_ex = socket.socket.connect_ex
_own_addresses: set[str] | None = None


def own_addresses() -> set[str]:
    """This machine's addresses: its host name's, and the one its default route leaves from
    (found as Ray finds its node address: a UDP `connect`, which sends nothing)."""
    global _own_addresses
    if _own_addresses is None:
        found = set()
        with contextlib.suppress(OSError):
            found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
        for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as udp:
                    udp.connect((probe, 9))
                    found.add(udp.getsockname()[0])
            except OSError:
                pass
        _own_addresses = {address.split("%")[0] for address in found}
    return _own_addresses


def is_local(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:  # a name: what it resolves to decides
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return True  # unresolvable: nothing can be reached
        return all(is_local(info[4][0]) for info in infos)
    if ip.is_loopback or ip.is_unspecified or str(ip) in own_addresses():
        return True
    links = filter(None, os.environ.get(ENV_LINKS, "").split(","))
    return any(ip in ipaddress.ip_network(cidr) for cidr in links)


def _check(sock: socket.socket, address: Any) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return
    host = address[0]
    if is_local(host):
        return
    line = f"pid {os.getpid()}: TCP connection to {address!r} refused by the test network guard"
    log = os.environ.get(ENV_LOG)
    if log and tuple(address[:2]) not in REFUSED_QUIETLY:
        with open(log, "a") as out:
            out.write(line + "\n")
    raise ConnectionRefusedError(line)


def _guarded_connect(self: socket.socket, address: Any) -> None:
    _check(self, address)
    return _original_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    _check(self, address)
    return _original_connect_ex(self, address)


def install() -> None:
    socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]
