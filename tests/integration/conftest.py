"""One Ray cluster for the whole integration session, started and stopped here.

It is a private local cluster (`address="local"`), never an existing one, and
it is shut down by this process only: no `ray stop`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.launch import RunOptions, RunResult, run
from shoal.launch.cluster import QUIET_ENV
from shoal.spec import load
from tests.conftest import write_workload

CLUSTER_CPUS = 6  # 2 cores here; logical CPUs leave room for Ray Data beside the workers


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    import ray

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster: str) -> Path:
    """A clean working directory: mlflow.db and shoal_runs/ land here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def run_in_thread(
    workdir: Path, data: dict, run_name: str, overrides: list[str] | None = None
) -> tuple[threading.Thread, dict[str, RunResult]]:
    """`run_workload` on a thread, so that a test can inject faults meanwhile."""
    outcome: dict[str, RunResult] = {}
    runner = threading.Thread(
        target=lambda: outcome.update(result=run_workload(workdir, data, overrides, run_name))
    )
    runner.start()
    return runner, outcome


def run_workload(
    workdir: Path, data: dict, overrides: list[str] | None = None, run_name: str = "job", **options
) -> RunResult:
    """One run; it logs no MLflow model unless its workload asks (`tracking.log_model`): that takes
    seconds per run, and only tests/integration/test_model_export.py is about it."""
    path = write_workload(workdir, data)
    overrides = list(overrides or [])
    if "log_model" not in data.get("tracking", {}) and not any(
        o.startswith("tracking.log_model") for o in overrides
    ):
        overrides.append("tracking.log_model=false")
    loaded = load(path, overrides, prepare_data=True)
    return run(loaded, RunOptions(run_name=run_name, **options))
