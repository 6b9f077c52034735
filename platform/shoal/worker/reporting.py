"""Getting numbers from the workers to the driver without slowing training.

`ray.train.report` is a barrier across ranks and is polled every ~2 s, so
workers buffer one record per optimizer step and report in batches: when the
report interval has passed on rank 0 (a decision shared with every rank through
the per-step all-reduce), at evaluations, at checkpoints and at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from shoal.errors import ShoalError
from shoal.messages import Event, EventKind, ProfileTrace, ReportSummary, StepRecord, WorkerReport
from shoal.worker.context import TrainContext
from shoal.worker.parallel.stats_ride import StatsRide


class MetricNamesError(ShoalError):
    """Ranks whose models returned different metrics: their values cannot be averaged."""


def agreed_names(names: list[str] | None, world_size: int, what: str) -> list[str]:
    """The metric names every rank sends (one gather); the same error on every rank when they
    differ. Ranks that send None (no batch to measure) do not take part."""
    if world_size == 1:
        return names or []
    gathered: list[list[str] | None] = [None] * world_size
    dist.all_gather_object(gathered, names)
    sent = {rank: tuple(n) for rank, n in enumerate(gathered) if n is not None}
    if len(set(sent.values())) > 1:
        listing = "; ".join(f"rank {rank}: {list(n)}" for rank, n in sent.items())
        raise MetricNamesError(
            f"the model returned different metrics on different ranks in {what} ({listing})"
        )
    return list(next(iter(sent.values()), ()))


class Reduced(NamedTuple):
    loss: float  # mean over the ranks that have one
    report_due: bool
    written: bool  # every rank has written its pending checkpoint
    per_rank: dict[str, list[float]]  # each per-rank value as a list over the ranks
    metrics: dict[str, float]  # the model's own metrics, averaged like the loss


class SharedStats(NamedTuple):
    """A step's numbers on their way to every rank (`StepStats.start`)."""

    values: torch.Tensor
    work: Any  # the all-reduce in flight, or None with one rank
    per_rank: list[str]  # the per-rank values' names, sorted


class StepStats:
    """All-reduce of [loss x weight, weight, report-due flag, ranks whose checkpoint write is
    done, ranks whose metric names changed, the model's metrics x weight, one slot per rank
    for each per-rank value]: one small collective per step, so that every rank takes the
    same decisions and rank 0 knows every rank's timings. The model's metric names are
    agreed once, at the first step."""

    def __init__(self, world_size: int, interval_s: float, rank: int):
        self.world_size, self.interval_s, self.rank = world_size, interval_s, rank
        self.last_report = time.monotonic()
        self.metric_names: list[str] | None = None

    def reduce(
        self,
        local_loss: float,
        weight: float = 1.0,
        written: bool = True,
        per_rank: dict[str, float] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Reduced:
        """Every rank passes the same `per_rank` keys; `metrics` are the model's 0-dim outputs,
        averaged over the step's micro-batches (a MetricNamesError on every rank when their
        names differ between ranks, or from those of the first step)."""
        return self.finish(self.start(local_loss, weight, written, per_rank, metrics))

    def start(
        self,
        local_loss: float,
        weight: float = 1.0,
        written: bool = True,
        per_rank: dict[str, float] | None = None,
        metrics: dict[str, float] | None = None,
        ride: StatsRide | None = None,
    ) -> SharedStats:
        """`reduce`'s all-reduce, started: `finish` waits for it, so that the step's last
        backward pass can run meanwhile; with a `ride`, that pass's gradient all-reduce
        carries it (call between the last forward and the last backward pass)."""
        metrics = metrics or {}
        if self.metric_names is None:
            self.metric_names = agreed_names(sorted(metrics), self.world_size, "training")
        names = self.metric_names
        changed = sorted(metrics) != names
        due = self.rank == 0 and time.monotonic() - self.last_report >= self.interval_s
        header = [local_loss * weight, weight, 1.0 if due else 0.0, 1.0 if written else 0.0, float(changed)]
        header += [metrics.get(name, 0.0) * weight for name in names]
        per_rank = per_rank or {}
        per_rank_names = sorted(per_rank)
        values = torch.from_numpy(self._with_per_rank_slots(header, per_rank, per_rank_names))
        work = None
        if self.world_size > 1:
            work = ride.carry(values) if ride else dist.all_reduce(values, async_op=True)
        return SharedStats(values, work, per_rank_names)

    def finish(self, shared: SharedStats) -> Reduced:
        if shared.work is not None:
            shared.work.wait()
        values, names = shared.values, self.metric_names or []
        loss, weight, due, written, changed = values[:5].tolist()
        if changed > 0:
            raise MetricNamesError(
                f"the model's metrics changed during training (the first step had {names})"
            )
        total_weight = max(weight, 1e-12)
        averaged = (values[5 : 5 + len(names)] / total_weight).tolist()
        rows = values[5 + len(names) :].view(-1, self.world_size).tolist() if shared.per_rank else []
        return Reduced(
            loss / total_weight,
            due > 0,
            written >= self.world_size,
            dict(zip(shared.per_rank, rows, strict=True)),
            dict(zip(names, averaged, strict=True)),
        )

    def _with_per_rank_slots(
        self, header: list[float], per_rank: dict[str, float], names: list[str]
    ) -> np.ndarray:
        """The header, then one slot per rank for each per-rank value (in `names`' order), this
        rank's filled: built in numpy, a tenth of the cost of setting tensor elements one by one."""
        values = np.zeros(len(header) + len(names) * self.world_size)
        values[: len(header)] = header
        for index, name in enumerate(names):
            values[len(header) + index * self.world_size + self.rank] = per_rank[name]
        return values

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
        # Every rank holds the same records and events; the driver reads rank 0's (Ray Train's
        # controller gets every rank's report, so the others' copies would grow with the world
        # squared), and every rank reports: the call is collective.
        lead = self.stats.rank == 0
        report = WorkerReport(summary, self.steps if lead else [], self.events if lead else [])
        if checkpoint_dir is None and self.profiles:  # checkpoint reports' metrics are kept by Ray
            report.profiles, self.profiles = self.profiles, []
        self.context.report(report.to_metrics(), checkpoint_dir, checkpoint_name, upload_in_background)
        self.steps, self.events = [], []
        self.stats.reported()
