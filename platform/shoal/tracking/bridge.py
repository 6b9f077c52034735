"""From Ray Train's controller to the driver.

`ForwardingCallback` runs inside the TrainController actor (Ray's design) and
forwards what workers report into a Ray queue; the driver's `Drainer`
(tracking/drain.py) empties it, and is the one process that writes MLflow. That
keeps tracking working when the store is a file on the driver's machine that the
cluster cannot reach. Messages cross the queue as plain data (shoal/queue_messages.py),
but for one: `ControllerAnnouncer` sends the controller's own actor handle as it
starts, so that a driver told to stop can abort training first.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.train import UserCallback

# A developer API: Ray Train appends run_config callbacks that are not UserCallbacks to its
# own, "so that custom workarounds built on top of internal callbacks work".
from ray.train.v2._internal.execution.callback import ControllerCallback

from shoal.queue_messages import ControllerMessage, FailureMessage, ReportMessage


def _checkpoint_path(checkpoint: Any) -> str | None:
    return getattr(checkpoint, "path", None) if checkpoint is not None else None


class ForwardingCallback(UserCallback):
    def __init__(self, queue: Any):
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        message = ReportMessage.from_ranks(metrics, _checkpoint_path(checkpoint))
        self.queue.put(message.to_dict())

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {rank: f"{type(exc).__name__}: {exc}"[:2000] for rank, exc in worker_exceptions.items()}
        self.queue.put(FailureMessage(errors).to_dict())


class ControllerAnnouncer(ControllerCallback):
    """Puts the controller's handle in the queue before any worker starts (UserCallback has
    no hook that early): the first message the driver reads."""

    def __init__(self, queue: Any):
        self.queue = queue

    def after_controller_start(self, train_run_context: Any) -> None:
        self.queue.put(ControllerMessage(ray.get_runtime_context().current_actor).to_dict())
