"""MLflow tracking, driver side only.

Its names load on first use, so that the driver's watch (`shoal.tracking.driver_watch`, a
process of its own through every run) starts without importing MLflow.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {
    "TrackedRun": "shoal.tracking.mlflow_run",
    "TrackingError": "shoal.tracking.mlflow_run",
    "open_run": "shoal.tracking.mlflow_run",
    "resolve_uri": "shoal.tracking.mlflow_run",
    "Observer": "shoal.tracking.recorder",
    "Recorder": "shoal.tracking.recorder",
    "RunState": "shoal.tracking.recorder",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'shoal.tracking' has no attribute {name!r}")
