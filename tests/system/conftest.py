"""System tests: real servers and clusters of their own on loopback (multi-node Ray, S3).

They run in a pytest process of their own (see the Makefile), so that the
integration tests' shared Ray cluster is not attached to this process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.launch.cluster import QUIET_ENV

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
