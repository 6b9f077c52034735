"""The driver's end of the report queue that `ForwardingCallback` (tracking/bridge.py) fills:
a thread that hands every message to the Recorder, and the best checkpoints to a keeper."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol

from shoal.queue_messages import ControllerMessage, ReportMessage, StopMessage, message_from_dict
from shoal.tracking.mlflow_run import RETRY_EVERY_S
from shoal.tracking.recorder import Recorder

log = logging.getLogger("shoal")
ABORT_TIMEOUT_S = 10.0  # a launcher that stops the driver (Slurm, Ray Jobs) waits about 30 s


class ReportQueue(Protocol):
    """What the Drainer needs of `ray.util.queue.Queue`."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...
    def put(self, item: Any) -> None: ...
    def size(self) -> int: ...
    def get_nowait_batch(self, num_items: int) -> list[Any]: ...


class CheckpointKeeper(Protocol):
    """Keeps the best checkpoint by score (launch/retention.py's BestKeeper)."""

    def offer(self, checkpoint_path: str, step: int, score: float | None) -> bool: ...


class Drainer(threading.Thread):
    """Moves messages from the controller's queue into the Recorder, on the driver."""

    def __init__(self, queue: ReportQueue, recorder: Recorder, keeper: CheckpointKeeper | None = None):
        super().__init__(name="shoal-drainer", daemon=True)
        self.queue, self.recorder, self.keeper = queue, recorder, keeper
        self.stopping = threading.Event()
        self.errors = 0
        self.controller: Any = None  # Ray Train's controller actor, announced as it starts

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                # Long waits: each wake is a call into the queue actor, CPU taken from training.
                message = self.queue.get(block=True, timeout=RETRY_EVERY_S)
            except queue.Empty:  # ray.util.queue.Empty is one
                self.recorder.run.flush()  # retries buffered writes while MLflow is away
                continue
            except Exception as exc:  # the queue actor went away with the cluster
                _lost_queue("lost the report queue", exc)
                return
            self._handle(message)  # a stop message is ignored; `stopping` then ends the loop

    def _handle(self, data: dict[str, Any]) -> None:
        try:
            message = message_from_dict(data)
            if isinstance(message, StopMessage):
                return
            if isinstance(message, ControllerMessage):
                self.controller = message.handle
                return
            self.recorder.handle(message)
            if self.keeper and isinstance(message, ReportMessage) and message.checkpoint:
                self.keeper.offer(message.checkpoint, message.summary.step, message.summary.score)
        except Exception:  # tracking trouble must not stop training
            self.errors += 1
            log.exception("could not record a report in MLflow")

    def stop_training(self) -> None:
        """Abort the controller and its workers, as Ray's own Ctrl-C handler does, so that
        nothing trains after the driver has decided how the run ends; every report the
        controller handled before is in the queue for `finish`. A second Ctrl-C stops the
        wait, not the closing of the run."""
        controller, self.controller = self.controller, None
        if controller is None:  # its handle not read yet: the workers end with this driver
            return
        import ray  # deferred: tests drive a Drainer without Ray

        log.info("stopping training (Ray Train's controller aborts its workers)")
        try:
            ray.get(controller.abort.remote(), timeout=ABORT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            log.warning(
                "Ray Train's controller did not abort in %.0f s: workers may train on", ABORT_TIMEOUT_S
            )
        except (Exception, KeyboardInterrupt) as exc:  # abort ends the controller, so the call fails
            log.debug("controller aborted: %s", type(exc).__name__)

    def forget_controller(self) -> None:
        """Training has ended: let the controller actor go."""
        self.controller = None

    def finish(self) -> None:
        """Record everything reported so far, then stop."""
        self.stopping.set()
        try:
            self.queue.put(StopMessage().to_dict())  # behind every report already queued: wakes the wait
        except Exception:  # the queue actor is gone: the wait ends with an error instead
            log.debug("report queue gone at finish", exc_info=True)
        self.join()
        try:
            remaining = self.queue.size()
            for message in self.queue.get_nowait_batch(remaining) if remaining else []:
                self._handle(message)
        except Exception as exc:
            _lost_queue("could not drain the last reports", exc)


def _lost_queue(what: str, exc: Exception) -> None:
    """One line: the queue's actor dies with the cluster (a cancelled Slurm job stops Ray on
    every node as the driver is told to stop), which is no fault of the run's; the
    traceback goes to the debug log."""
    log.warning("%s: %s: %s", what, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
    log.debug("%s", what, exc_info=exc)
