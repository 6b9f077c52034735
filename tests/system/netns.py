"""Network namespaces of a test's own, joined by veth links through a bridge: real links
to take down, slow down or make lossy (`tc netem`).

Each node is a namespace `shoal<pid>-NAME` with one interface, `eth0`, whose peer is a port
of the bridge in the hub namespace `shoal<pid>-hub`; nothing is made in the host's own
namespace, so the nodes reach each other and nothing else. Every address is in `subnet`,
which exists only on these links. A plain link is a veth pair; a shaped one (loss, delay)
is a pair of TAP devices with `link_relay.py` between them, since this kernel has no
`sch_netem`. `close()` (also on a failure) kills what was started in the namespaces and
deletes them, which takes their links with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMMAND_TIMEOUT_S = 30


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def why_not_permitted() -> str | None:
    """None where this process may create network namespaces and veth links, else why not."""
    probe = f"shoal{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"`ip netns add` is not permitted here: {detail.strip()}"
    try:
        _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"veth links cannot be made here: {(getattr(exc, 'stderr', '') or str(exc)).strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


@dataclass
class Node:
    namespace: str
    address: str
    hub_port: str  # its link's end on the bridge, in the hub namespace


class Network:
    """Use as a context manager; `add` nodes, `popen` processes in them, then fault the links."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch  # logs and the shaped links' settings
        self.tag = f"shoal{os.getpid()}"
        self.third_octet = 1 + os.getpid() % 250
        self.subnet = f"10.213.{self.third_octet}.0/24"
        self.hub = f"{self.tag}-hub"
        self.nodes: list[Node] = []
        self.processes: list[subprocess.Popen] = []
        # Ray's temp dir for every process in the nodes: short (Ray's socket paths must be),
        # and removed by close(), so no /tmp/ray/ray_current_cluster names a dead cluster after
        self.ray_tmp = tempfile.mkdtemp(prefix=f"{self.tag}-ray-")

    def __enter__(self) -> Network:
        _ip("netns", "add", self.hub)
        self._in(self.hub, "link", "set", "lo", "up")
        self._in(self.hub, "link", "add", "br0", "type", "bridge")
        self._in(self.hub, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _in(self, namespace: str, *args: str) -> None:
        _ip("-n", namespace, *args)

    def add(self, name: str, shaped: bool = False) -> Node:
        """A node on the bridge; `shaped`: its link can lose and delay packets (`shape`)."""
        namespace, index = f"{self.tag}-{name}", len(self.nodes) + 1
        node = Node(namespace, f"10.213.{self.third_octet}.{index}", f"p{index}")
        _ip("netns", "add", namespace)
        self.nodes.append(node)
        self._in(namespace, "link", "set", "lo", "up")
        if shaped:
            self._relay(node)
        else:
            peer = ("peer", "name", "eth0", "netns", namespace)
            self._in(self.hub, "link", "add", node.hub_port, "type", "veth", *peer)
        self._in(self.hub, "link", "set", node.hub_port, "master", "br0", "up")
        self._in(namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
        self._in(namespace, "link", "set", "eth0", "up")
        return node

    def _relay(self, node: Node) -> None:
        self.shape(node)
        relay = Path(__file__).with_name("link_relay.py")
        args = [sys.executable, str(relay), self.hub, node.hub_port, str(self._settings(node))]
        process = subprocess.Popen(
            ["ip", "netns", "exec", node.namespace, *args],
            stdout=subprocess.PIPE,
            stderr=(self.scratch / f"relay-{node.hub_port}.log").open("w"),
            start_new_session=True,
            text=True,
            env=self.env(),
        )
        self.processes.append(process)
        assert process.stdout is not None
        ready = process.stdout.readline()  # bounded: the relay prints it or exits
        assert ready.strip() == "ready", f"the link relay of {node.namespace} did not start"

    def _settings(self, node: Node) -> Path:
        return self.scratch / f"link-{node.hub_port}.json"

    def shape(self, node: Node, loss: float = 0.0, delay_ms: float = 0.0, jitter_ms: float = 0.0) -> None:
        """Loss (a share of frames, each way) and delay (ms, each way) on a shaped link, now."""
        settings = self._settings(node)
        settings.with_suffix(".tmp").write_text(
            json.dumps({"loss": loss, "delay_ms": delay_ms, "jitter_ms": jitter_ms})
        )
        settings.with_suffix(".tmp").replace(settings)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process in a node: the test network guard lets it reach the
        links' subnet, which exists only inside these namespaces; Ray's temp dir is the network's."""
        return {**os.environ, "SHOAL_NETGUARD_LINKS": self.subnet, "RAY_TMPDIR": self.ray_tmp, **extra}

    def popen(self, node: Node, args: list[str], log: Path, **kwargs: Any) -> subprocess.Popen:
        """A process in `node`'s namespace, in a session of its own, output to `log`."""
        out = log.open("a")
        process = subprocess.Popen(
            ["ip", "netns", "exec", node.namespace, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=kwargs.pop("env", None) or self.env(),
            **kwargs,
        )
        out.close()
        self.processes.append(process)
        return process

    def run(self, node: Node, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", node.namespace, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=self.env(),
        )

    def link_counts(self, node: Node) -> dict[str, int]:
        """Frames a shaped link carried and dropped so far."""
        return json.loads(self._settings(node).with_suffix(".stats").read_text())

    def link_down(self, node: Node) -> None:
        self._in(self.hub, "link", "set", node.hub_port, "down")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=COMMAND_TIMEOUT_S)
        for namespace in [node.namespace for node in self.nodes] + [self.hub]:
            # whatever still runs inside (Ray's daemons outlive a killed driver) is this test's
            inside = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
            for pid in inside.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
