"""Getting numbers from the workers to the driver without slowing training.

`ray.train.report` is a barrier across ranks and is polled every ~2 s, so
workers buffer one record per optimizer step and report in batches: when the
report interval has passed on rank 0 (a decision shared with every rank through
the per-step all-reduce), at evaluations, at checkpoints and at the end.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from shoal.messages import Event, EventKind, ProfileTrace, ReportSummary, StepRecord, WorkerReport


class StepStats:
    """All-reduce of [loss x weight, weight, report-due flag, ranks whose checkpoint write is
    done, one slot per rank for each per-rank value]: one small collective per step, so that
    every rank takes the same decisions and rank 0 knows every rank's timings."""

    def __init__(self, world_size: int, interval_s: float, rank: int):
        self.world_size, self.interval_s, self.rank = world_size, interval_s, rank
        self.last_report = time.monotonic()

    def reduce(
        self,
        local_loss: float,
        weight: float = 1.0,
        written: bool = True,
        per_rank: dict[str, float] | None = None,
    ) -> tuple[float, bool, bool, dict[str, list[float]]]:
        """Mean loss over the ranks that have one (pipeline stages before the last have none),
        whether a report is due, whether every rank has written its pending checkpoint, and
        each of `per_rank`'s values as a list over the ranks (every rank passes the same keys)."""
        due = self.rank == 0 and time.monotonic() - self.last_report >= self.interval_s
        flags = [1.0 if due else 0.0, 1.0 if written else 0.0]
        names = sorted(per_rank or {})
        slots = torch.zeros(len(names) * self.world_size, dtype=torch.float64)
        for index, name in enumerate(names):
            slots[index * self.world_size + self.rank] = float(per_rank[name])  # type: ignore[index]
        values = torch.cat([torch.tensor([local_loss * weight, weight, *flags], dtype=torch.float64), slots])
        if self.world_size > 1:
            dist.all_reduce(values)
        loss = values[0].item() / max(values[1].item(), 1e-12)
        rows = values[4:].view(len(names), self.world_size).tolist() if names else []
        return (
            loss,
            values[2].item() > 0,
            values[3].item() >= self.world_size,
            dict(zip(names, rows, strict=True)),
        )

    def reported(self) -> None:
        self.last_report = time.monotonic()


class Reporter:
    """Buffers per-step records and events and sends them through ray.train.report.

    `steps`, `events` and `profiles` hold plain data (messages.py's `to_dict` forms): that is
    what ray.train.report carries, and what the loop keeps of them in its next checkpoint."""

    def __init__(self, stats: StepStats):
        self.stats = stats
        self.steps: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.profiles: list[dict[str, Any]] = []  # every rank's traces go to the driver

    def record_step(self, record: StepRecord | Mapping[str, Any]) -> StepRecord:
        typed = record if isinstance(record, StepRecord) else StepRecord.from_dict(record)
        self.steps.append(typed.to_dict())
        return typed

    def event(self, kind: EventKind | str, **fields: Any) -> Event:
        return self.add_event(Event(EventKind(kind), time.time(), fields))

    def add_event(self, event: Event) -> Event:
        self.events.append(event.to_dict())
        return event

    def send(
        self,
        summary: ReportSummary | Mapping[str, Any],
        checkpoint: Any = None,
        checkpoint_dir_name: str | None = None,
        upload_in_background: bool = False,
    ) -> None:
        import ray.train

        report = WorkerReport(
            ReportSummary.coerce(summary),
            [StepRecord.from_dict(record) for record in self.steps],
            [Event.from_dict(event) for event in self.events],
        )
        if checkpoint is None and self.profiles:  # checkpoint reports' metrics are kept by Ray
            report.profiles = [ProfileTrace.from_dict(trace) for trace in self.profiles]
            self.profiles = []
        options = {}
        if upload_in_background:  # Ray copies to storage on a thread, then deletes the local files
            options = {
                "checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC,
                "delete_local_checkpoint_after_upload": True,
            }
        metrics = report.to_metrics()
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name, **options)
        self.steps, self.events = [], []
        self.stats.reported()
