"""Getting numbers from the workers to the driver without slowing training.

`ray.train.report` is a barrier across ranks and is polled every ~2 s, so
workers buffer one record per optimizer step and report in batches: when the
report interval has passed on rank 0 (a decision shared with every rank through
the per-step all-reduce), at evaluations, at checkpoints and at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shoal.messages import Event, EventKind, ProfileTrace, ReportSummary, StepRecord, WorkerReport
from shoal.worker.context import TrainContext


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
    """Buffers per-step records and events and sends them through the context's report."""

    def __init__(self, stats: StepStats, context: TrainContext):
        self.stats, self.context = stats, context
        self.steps: list[StepRecord] = []
        self.events: list[Event] = []
        self.profiles: list[ProfileTrace] = []  # every rank's traces go to the driver

    def record_step(self, record: StepRecord) -> StepRecord:
        self.steps.append(record)
        return record

    def event(self, kind: EventKind, **fields: Any) -> Event:
        event = Event(EventKind(kind), time.time(), fields)
        self.events.append(event)
        return event

    def send(
        self,
        summary: ReportSummary,
        checkpoint_dir: Path | None = None,
        checkpoint_name: str | None = None,
        upload_in_background: bool = False,
    ) -> None:
        report = WorkerReport(summary, self.steps, self.events)
        if checkpoint_dir is None and self.profiles:  # checkpoint reports' metrics are kept by Ray
            report.profiles, self.profiles = self.profiles, []
        self.context.report(report.to_metrics(), checkpoint_dir, checkpoint_name, upload_in_background)
        self.steps, self.events = [], []
        self.stats.reported()
