"""From Ray Train's controller to the driver.

`ForwardingCallback` runs inside the TrainController actor (Ray's design) and
only forwards what workers report into a Ray queue; the driver drains it and is
the one process that writes MLflow. That keeps tracking working when the store
is a file on the driver's machine that the cluster cannot reach.
"""

from __future__ import annotations

import time
from typing import Any

from ray.train import UserCallback


def _checkpoint_path(checkpoint: Any) -> str | None:
    return getattr(checkpoint, "path", None) if checkpoint is not None else None


class ForwardingCallback(UserCallback):
    def __init__(self, queue: Any):
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        lead = metrics[0] if metrics else {}
        message = {
            "type": "report",
            "summary": {k: v for k, v in lead.items() if not k.startswith("shoal_")},
            "steps": lead.get("shoal_steps", []),
            "events": lead.get("shoal_events", []),
            "checkpoint": _checkpoint_path(checkpoint),
            "profiles": [trace for rank in metrics for trace in rank.get("shoal_profiles", [])],
        }
        self.queue.put(message)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {rank: f"{type(exc).__name__}: {exc}"[:2000] for rank, exc in worker_exceptions.items()}
        self.queue.put({"type": "failure", "errors": errors, "time": time.time()})
