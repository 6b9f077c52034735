"""Shared test setup: a private data cache, and helpers to write workloads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "workloads"


@pytest.fixture(scope="session", autouse=True)
def private_data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built-in corpora go to a per-session cache, not the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("shoal-data-cache")
    os.environ["SHOAL_DATA_CACHE"] = str(cache)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return cache


def write_workload(directory: Path, data: dict, name: str = "w.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def quickstart() -> dict:
    return yaml.safe_load((WORKLOADS / "quickstart.yaml").read_text())
