"""What one optimizer step leaves in its record: its own timings and throughput, every
rank's values from the step's all-reduce, and the time the training thread spent between
steps (evaluation, checkpoint, report), which the next step's record carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.messages import Metric, checkpoint_phase_metric

if TYPE_CHECKING:
    from shoal.worker.engine import Engine


class Stalls:
    """Seconds spent between steps, by metric, until the next step's record takes them. A
    stall is a point in its series at the step after it happened, and only there: most steps
    have none, and a zero at each of them only made rows for the tracking store to write."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, metric: str, seconds: float) -> None:
        self.seconds[metric] = self.seconds.get(metric, 0.0) + seconds

    def add_checkpoint(self, blocked: dict[str, float]) -> None:
        """The time a checkpoint held the training thread, by phase and in all."""
        for phase, seconds in blocked.items():
            self.add(checkpoint_phase_metric(phase), seconds)
            self.add(Metric.TIME_CHECKPOINT_S, seconds)

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


@dataclass
class StepTiming:
    """One step's wall time (the previous step's end to this one's), by part."""

    elapsed: float
    data_wait: float
    phases: dict[str, float] = field(default_factory=dict)


def step_values(
    engine: Engine,
    loss: float,
    timing: StepTiming,
    samples: int,
    world: int,
    flops_per_step: float | None,
) -> dict[str, float]:
    """The metrics of a step of `samples` (the global batch) every rank trained on: the
    stalls and per-rank values are added by the caller."""
    elapsed, phases = timing.elapsed, timing.phases
    values = {
        Metric.TRAIN_LOSS: loss,
        Metric.TRAIN_LR: engine.lr,
        Metric.TRAIN_GRAD_NORM: engine.last_grad_norm,
        Metric.TRAIN_SAMPLES_PER_S: samples / elapsed,
        Metric.TRAIN_SAMPLES_PER_S_PER_WORKER: samples / elapsed / world,
        Metric.TRAIN_DATA_WAIT_SHARE: timing.data_wait / elapsed,  # of this step's wall time
        Metric.TIME_STEP_S: elapsed,
        Metric.TIME_DATA_WAIT_S: timing.data_wait,
        Metric.TIME_FORWARD_BACKWARD_S: phases.get("forward_backward", 0.0),
        Metric.TIME_FORWARD_S: phases.get("forward", 0.0),
        Metric.TIME_OPTIMIZER_S: phases.get("optimizer", 0.0),
    }
    if flops_per_step:
        values[Metric.PERF_TFLOPS] = flops_per_step / elapsed / 1e12
        values[Metric.PERF_TFLOPS_PER_WORKER] = values[Metric.PERF_TFLOPS] / world
    if engine.precision.scaler is not None:
        values[Metric.TRAIN_SKIPPED_STEPS] = engine.precision.skipped_steps
    return values


def tokens_per_s(samples: int, predicted_per_sample: int, elapsed: float, world: int) -> dict[str, float]:
    """A language model's throughput: the tokens it predicted per second, in all and per worker."""
    rate = samples * predicted_per_sample / elapsed
    return {Metric.TRAIN_TOKENS_PER_S: rate, Metric.TRAIN_TOKENS_PER_S_PER_WORKER: rate / world}
