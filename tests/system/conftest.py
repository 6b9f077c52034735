"""System tests: real servers and clusters of their own on loopback (multi-node Ray, S3).

They run in a pytest process of their own (see the Makefile), so that the
integration tests' shared Ray cluster is not attached to this process.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shoal.launch.cluster import QUIET_ENV
from tests.integration.helpers import wait_for

# Node loss is noticed by the GCS's health checks (default: 5 misses of a 3 s check),
# then Ray Train retries the old size for failure.worker_start_timeout_s before shrinking.
FAST_NODE_FAILURE = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)
    return tmp_path


@pytest.fixture
def local_cluster() -> Iterator:
    """A head node (1 CPU: the driver's datasets, Ray Train's controller) without room
    for a training worker; tests add and remove 2-CPU worker nodes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 1, "_system_config": dict(FAST_NODE_FAILURE), "include_dashboard": False},
    )
    try:
        yield cluster
    finally:
        cluster.shutdown()  # its own processes only
        os.environ.pop("RAY_ADDRESS", None)


@dataclass
class RayStartCluster:
    """A cluster made with `ray start` (head with dashboard + one worker node), token auth on."""

    gcs: str
    dashboard: str
    env: dict[str, str]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _stop_group(process: subprocess.Popen) -> None:
    """End one `ray start --block` and everything it started, by its own process group."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for_nodes(env: dict[str, str], gcs: str, count: int, timeout_s: float = 90) -> None:
    script = (
        f"import ray; ray.init(address='{gcs}', log_to_driver=False); "
        "print(len([n for n in ray.nodes() if n['Alive']]))"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise AssertionError(f"the cluster at {gcs} did not reach {count} nodes: {done.stderr[-2000:]}")


@pytest.fixture(scope="module")
def ray_start_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayStartCluster]:
    """`ray start --head` (dashboard, Jobs API) plus a second node via `ray start --address`, both
    in process groups of their own and stopped through them (never `ray stop`)."""
    from ray.util import get_node_ip_address

    logs = tmp_path_factory.mktemp("ray-start-logs")
    gcs_port, dashboard_port = _free_port(), _free_port()
    gcs = f"{get_node_ip_address()}:{gcs_port}"
    # A token of this cluster's own: a fresh machine has no ~/.ray/auth_token to fall back on.
    token = secrets.token_hex(32)
    env = {**os.environ, **QUIET_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_ADDRESS": gcs}
    ray_cli = str(Path(sys.executable).parent / "ray")
    head_args = [
        "--head",
        f"--port={gcs_port}",
        f"--dashboard-port={dashboard_port}",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=4",
    ]
    started = []
    try:
        for name, args in (("head", head_args), ("node", [f"--address={gcs}", "--num-cpus=2"])):
            started.append(
                subprocess.Popen(
                    [ray_cli, "start", "--block", "--disable-usage-stats", *args],
                    env={k: v for k, v in env.items() if not (name == "head" and k == "RAY_ADDRESS")},
                    stdout=(logs / f"{name}.log").open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            _wait_for_nodes(env, gcs, len(started))
        yield RayStartCluster(gcs, f"http://127.0.0.1:{dashboard_port}", env)
    finally:
        for process in reversed(started):
            _stop_group(process)


class MlflowServer:
    def __init__(self, root: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.root, self.process = root, None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [
            sys.executable, "-m", "mlflow", "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
            "--workers", "1",
        ]  # fmt: skip
        log = open(self.root / "server.log", "a")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        wait_for(self.healthy, 120, "the MLflow server to answer /health")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the server and its workers
            self.process.wait()

    def rest(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.uri}/api/2.0/mlflow/{path}", timeout=10) as response:
            return json.loads(response.read())


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    root = tmp_path / "mlflow-server"
    root.mkdir()
    server = MlflowServer(root)
    server.start()
    try:
        yield server
    finally:
        server.kill()
