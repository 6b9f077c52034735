"""Shared test setup: no connection leaves the machine, a private data cache, and helpers
to write workloads."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "workloads"
NETGUARD = REPO / "tests" / "netguard"


def _guard_the_network() -> Path:
    """Every process of the session (this one, and through sitecustomize.py every Python
    process it starts: CLIs, Ray's workers, MLflow servers) refuses TCP off this machine."""
    log = Path(tempfile.mkdtemp(prefix="shoal-netguard-")) / "refused.log"
    log.touch()
    os.environ["SHOAL_NETGUARD_LOG"] = str(log)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # a dashboard would report them to Ray's server
    paths = [str(NETGUARD), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    sys.path.insert(0, str(NETGUARD))
    import shoal_netguard

    shoal_netguard.install()
    return log


NETGUARD_LOG = _guard_the_network()

# Ray Train's controller polls its workers every 2 s by default, and a worker's report (shoal's
# at checkpoints, evaluations and the end of a run) waits for the next poll: tests' runs report
# often, so they poll every 0.5 s (about 10 s less per 40-step run). Every Ray cluster and CLI the
# session starts inherits it; the controller gets the driver's value.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(autouse=True)
def no_connection_leaves_the_machine() -> Iterator[None]:
    """Fails the test during which any process tried to reach another machine."""
    before = NETGUARD_LOG.stat().st_size
    yield
    with NETGUARD_LOG.open() as log:
        log.seek(before)
        refused = log.read()
    if refused:
        pytest.fail(f"a connection off this machine was attempted:\n{refused}")


@pytest.fixture(scope="session", autouse=True)
def private_data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built-in corpora go to a per-session cache, not the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("shoal-data-cache")
    os.environ["SHOAL_DATA_CACHE"] = str(cache)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return cache


@pytest.fixture(autouse=True)
def no_tracking_uri_leaks() -> Iterator[None]:
    """`mlflow.set_tracking_uri` (a test's, or an example script's) sets MLflow's global URI and
    $MLFLOW_TRACKING_URI for the rest of the process: unset both after each test."""
    yield
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        mlflow.set_tracking_uri(None)


def write_workload(directory: Path, data: dict, name: str = "w.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def quickstart() -> dict:
    return yaml.safe_load((WORKLOADS / "quickstart.yaml").read_text())
