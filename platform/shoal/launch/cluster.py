"""Attaching to a Ray cluster, or starting a local one for the length of a job."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ShoalError
from shoal.redact import redact_logs

# Quiet defaults, set before Ray starts so that its processes inherit them.
QUIET_ENV = {
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    "RAY_DATA_LOG_LEVEL": "WARNING",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "PYTHONWARNINGS": "ignore::DeprecationWarning",
}
PROBE_TIMEOUT_S = 5.0


class ClusterError(ShoalError, RuntimeError):
    """A Ray cluster that cannot be reached or started."""


@dataclass
class RaySession:
    address: str
    started_here: bool
    cpus: float


def _host_port(address: str) -> tuple[str, int] | None:
    text = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def probe(address: str) -> None:
    """Fail fast on an address nobody listens at (ray.init would wait minutes)."""
    if address == "auto":
        return
    target = _host_port(address)
    if target is None:
        raise ClusterError(f"--address '{address}' is not HOST:PORT (for example 127.0.0.1:6379)")
    try:
        with socket.create_connection(target, timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster at --address '{address}' ({exc.strerror or exc}); "
            "start one with `ray start --head` or omit --address to run locally"
        ) from None


def quiet_ray_logging(log_file: Path | None, verbose: bool) -> None:
    """Send Ray's Python loggers to the run's log file instead of the terminal."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    redact_logs(logging.getLogger("shoal"))
    if verbose or log_file is None:
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    redact_logs(handler)  # Ray's and MLflow's messages may quote a URI with its credentials
    for name in ("ray", "ray.train", "ray.data", "ray.tune", "mlflow", "alembic"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def local_cpus(wanted: float) -> int:
    """Logical CPUs for a local Ray: enough for the workers plus Ray Data and the controller."""
    return max(os.cpu_count() or 1, int(wanted + 0.999) + 2)


@contextmanager
def ray_session(
    address: str | None, cpus_wanted: float, verbose: bool = False, dashboard: bool = False
) -> Iterator[RaySession]:
    """Use the Ray already initialised in this process, attach to `address` (else $RAY_ADDRESS),
    or start one."""
    # deferred: Ray loads when a cluster is used; `shoal runs show` imports launch/ and uses none
    import ray

    if ray.is_initialized():
        yield RaySession(ray.get_runtime_context().gcs_address, False, ray.cluster_resources().get("CPU", 0))
        return
    address = address or os.environ.get("RAY_ADDRESS")  # set by Ray in a job's driver, as by users
    pinned: dict[str, str] = {}
    common = {
        "log_to_driver": verbose,
        "logging_level": logging.INFO if verbose else logging.WARNING,
    }
    if address:
        probe(address)
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterError(f"cannot attach to Ray at '{address}': {exc}") from None
        started = False
    else:
        pinned = _pinned_address() if dashboard else lean_ray_env()
        os.environ.update(pinned)
        try:
            ray.init(address="local", num_cpus=local_cpus(cpus_wanted), include_dashboard=dashboard, **common)
        except BaseException:
            _unpin(pinned)
            raise
        started = True
    try:
        yield RaySession(
            ray.get_runtime_context().gcs_address, started, ray.cluster_resources().get("CPU", 0)
        )
    finally:
        ray.shutdown()
        _unpin(pinned)


# Without a dashboard nothing reads Ray's own metrics, yet every Ray process would keep
# recording and exporting them: 0.7-1.2% of the training throughput in a paired A/B on 2 cores.
LEAN_LOCAL_RAY = {"RAY_enable_metrics_collection": "false"}


def lean_ray_env() -> dict[str, str]:
    """The settings of LEAN_LOCAL_RAY that the user has not set: for a Ray started without a
    dashboard, to be put in the environment before it starts and taken out after."""
    return {key: value for key, value in LEAN_LOCAL_RAY.items() if key not in os.environ}


def _pinned_address() -> dict[str, str]:
    """A GCS port chosen before a local Ray starts, and RAY_ADDRESS naming it, so that every Ray
    process inherits the address. Ray Train's placement-group cleaner finds the cluster's State
    API through it; without, it follows /tmp/ray/ray_current_cluster, which `ray.init` does not
    write, to whatever cluster last wrote it, and placement groups of stopped trials leak."""
    # deferred: Ray loads when a cluster is used; `shoal runs show` imports launch/ and uses none
    from ray.util import get_node_ip_address

    with socket.socket() as probe_socket:
        probe_socket.bind(("", 0))
        port = probe_socket.getsockname()[1]
    return {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"{get_node_ip_address()}:{port}"}


def _unpin(pinned: dict[str, str]) -> None:
    for key in pinned:
        os.environ.pop(key, None)
