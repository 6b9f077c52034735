"""MLflow tracking, driver side only."""

from shoal.tracking.mlflow_run import TrackedRun, TrackingError, open_run, resolve_uri
from shoal.tracking.recorder import Observer, Recorder, RunState

__all__ = [
    "Observer",
    "Recorder",
    "RunState",
    "TrackedRun",
    "TrackingError",
    "open_run",
    "resolve_uri",
]
