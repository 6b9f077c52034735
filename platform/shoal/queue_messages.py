"""The messages of the queue from Ray Train's controller to the driver.

`ForwardingCallback` (tracking/bridge.py) puts them, the driver's `Drainer`
(tracking/drain.py) takes them: the workers' reports as Ray's controller sees them,
failures, and the driver's own stop. They travel as plain data (`to_dict()` /
`from_dict()`), as the records they carry do (shoal/messages.py), but for
`ControllerMessage`: an actor handle, which Ray serializes itself.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shoal.messages import (
    PROFILES_KEY,
    Event,
    EventKind,
    ProfileTrace,
    ReportSummary,
    StepRecord,
    WorkerReport,
)


class MessageType(StrEnum):
    """The driver-side queue's messages, from Ray Train's controller to the Drainer."""

    REPORT = "report"
    FAILURE = "failure"
    STOP = "shoal.stop"  # put by the driver itself: ends the Drainer
    CONTROLLER = "controller"


@dataclass
class ReportMessage:
    """A report of the workers (rank 0's summary, steps and events; every rank's profiles)
    with the checkpoint Ray committed for it, if any."""

    summary: ReportSummary
    steps: list[StepRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    checkpoint: str | None = None  # the committed checkpoint's path in storage
    profiles: list[ProfileTrace] = field(default_factory=list)

    @classmethod
    def from_ranks(cls, per_rank_metrics: list[Mapping[str, Any]], checkpoint: str | None) -> ReportMessage:
        """One message from every rank's `ray.train.report` metrics, as the controller sees them:
        the steps and events are rank 0's; profiles from each."""
        lead = WorkerReport.from_metrics(per_rank_metrics[0])
        profiles = [
            ProfileTrace.from_dict(trace)
            for metrics in per_rank_metrics
            for trace in metrics.get(PROFILES_KEY, [])
        ]
        return cls(lead.summary, lead.steps, lead.events, checkpoint, profiles)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": MessageType.REPORT.value,
            "summary": self.summary.to_dict(),
            "steps": [record.to_dict() for record in self.steps],
            "events": [event.to_dict() for event in self.events],
            "checkpoint": self.checkpoint,
            "profiles": [trace.to_dict() for trace in self.profiles],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReportMessage:
        return cls(
            ReportSummary.from_dict(data["summary"]),
            [StepRecord.from_dict(record) for record in data["steps"]],
            [Event.from_dict(event) for event in data["events"]],
            data["checkpoint"],
            [ProfileTrace.from_dict(trace) for trace in data["profiles"]],
        )


@dataclass
class FailureMessage:
    """Workers that failed (Ray Train restarts the attempt): their errors by rank."""

    errors: dict[int, str]
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"type": MessageType.FAILURE.value, "errors": dict(self.errors), "time": self.time}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FailureMessage:
        # JSON turns the ranks into strings
        return cls({int(rank): error for rank, error in data["errors"].items()}, data["time"])

    def event(self) -> Event:
        return Event(EventKind.FAILURE, self.time, {"errors": dict(self.errors)})


@dataclass
class StopMessage:
    """Ends a Drainer once every message queued before it is handled."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": MessageType.STOP.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StopMessage:
        return cls()


@dataclass
class ControllerMessage:
    """The TrainController actor's handle, sent before its first report: a driver told to stop
    aborts training with it (as Ray's own Ctrl-C does), so nothing trains after the run ends."""

    handle: Any

    def to_dict(self) -> dict[str, Any]:
        return {"type": MessageType.CONTROLLER.value, "handle": self.handle}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ControllerMessage:
        return cls(data["handle"])


QueueMessage = ReportMessage | FailureMessage | StopMessage | ControllerMessage
_MESSAGE_CLASSES: dict[MessageType, type[QueueMessage]] = {
    MessageType.REPORT: ReportMessage,
    MessageType.FAILURE: FailureMessage,
    MessageType.STOP: StopMessage,
    MessageType.CONTROLLER: ControllerMessage,
}


def message_from_dict(data: Mapping[str, Any]) -> QueueMessage:
    """A queue message back from its plain form (its `type` says which)."""
    return _MESSAGE_CLASSES[MessageType(data["type"])].from_dict(data)
