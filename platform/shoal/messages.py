"""The one message format between the workers and the driver.

A report's path: the worker's `Reporter` -> `ray.train.report(metrics)` -> the
`ForwardingCallback` in Ray Train's controller -> a Ray queue -> the driver's
`Drainer` -> the `Recorder` -> MLflow. Every name on that path (event kinds,
metric names, the loop's outcomes) and every record's shape is defined here, once.

Across each process boundary messages travel as plain data (dicts, lists, str,
numbers): `ray.train.report` keeps a checkpoint report's metrics as JSON in its
own state, the Ray queue and the checkpoint's trainer_state.json outlive one
version of these classes, and events.json in MLflow is read back by later
drivers. Each class converts explicitly: `to_dict()` / `from_dict()`.

No torch and no Ray here: the worker and the driver both import this module.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class EventKind(StrEnum):
    """What happened during a job: one entry of events.json each."""

    # reported by the workers
    ATTEMPT_STARTED = "attempt_started"
    ROLLED_BACK = "rolled_back"
    RESIZED = "resized"
    EVAL = "eval"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # due while the previous one was still being written
    NAN_SKIP = "nan_skip"
    NAN_ROLLBACK = "nan_rollback"
    FATAL = "fatal"
    FLOPS_UNAVAILABLE = "flops_unavailable"
    STRAGGLER = "straggler"
    STRAGGLER_RECOVERED = "straggler_recovered"
    # recorded by the driver
    PROFILE = "profile"
    FAILURE = "failure"
    JOB_RESUMED = "job_resumed"

    @classmethod
    def for_nan_policy(cls, policy: str) -> EventKind:
        """failure.on_nan's `skip` or `rollback` -> the event saying a step was left out."""
        return cls(f"nan_{policy}")


class LoopOutcome(StrEnum):
    """How one pass of the training loop over the data stream ended."""

    DONE = "done"  # the planned steps are trained
    FATAL = "fatal"  # a failure no restart can fix (already reported)
    ROLLBACK = "rollback"  # a non-finite loss: back to the last checkpoint
    SKIP = "skip"  # a non-finite loss: this step's update is dropped, training goes on
    EXHAUSTED = "exhausted"  # the data ran out before the planned steps


class Metric(StrEnum):
    """Every metric name shoal logs to MLflow (per-rank ones: `worker_metric`, `gpu_metric`)."""

    TRAIN_LOSS = "train/loss"
    TRAIN_LR = "train/lr"
    TRAIN_GRAD_NORM = "train/grad_norm"
    TRAIN_SAMPLES_PER_S = "train/samples_per_s"
    TRAIN_SAMPLES_PER_S_PER_WORKER = "train/samples_per_s_per_worker"
    TRAIN_TOKENS_PER_S = "train/tokens_per_s"
    TRAIN_TOKENS_PER_S_PER_WORKER = "train/tokens_per_s_per_worker"
    TRAIN_DATA_WAIT_SHARE = "train/data_wait_share"  # of the step's wall time
    TRAIN_EPOCH = "train/epoch"
    TRAIN_SKIPPED_STEPS = "train/skipped_steps"  # by the fp16 grad scaler
    TIME_STEP_S = "time/step_s"
    TIME_DATA_WAIT_S = "time/data_wait_s"
    TIME_FORWARD_BACKWARD_S = "time/forward_backward_s"
    TIME_FORWARD_S = "time/forward_s"
    TIME_OPTIMIZER_S = "time/optimizer_s"
    TIME_CHECKPOINT_S = "time/checkpoint_s"
    TIME_EVAL_S = "time/eval_s"
    TIME_REPORT_S = "time/report_s"  # sending the buffered records to the driver (Ray Train's report)
    TIME_BUSY_MAX_S = "time/busy_max_s"
    TIME_BUSY_MEDIAN_S = "time/busy_median_s"
    MEMORY_PEAK_MB = "memory/peak_mb"
    PERF_TFLOPS = "perf/tflops"
    PERF_TFLOPS_PER_WORKER = "perf/tflops_per_worker"
    PERF_MFU = "perf/mfu"  # computed by the driver, which knows the GPUs' peak
    VAL_LOSS = "val/loss"
    VAL_ACCURACY = "val/accuracy"
    ATTEMPT = "attempt"  # the attempt number, logged at the step it started from


class WorkerValue(StrEnum):
    """A value every worker measures for itself, logged as `worker/<rank>/<value>`."""

    BUSY_S = "busy_s"  # the worker's own share of the step: data wait and forward passes
    LINK_RTT_S = "link_rtt_s"  # a TCP handshake's round trip to the cluster's head (median)


class GpuReading(StrEnum):
    """A worker's GPU readings (NVML), logged as `gpu/<rank>/<reading>`."""

    UTILIZATION_PCT = "utilization_pct"
    MEMORY_USED_MB = "memory_used_mb"
    POWER_W = "power_w"
    TEMPERATURE_C = "temperature_c"


class DataCount(StrEnum):
    """What a rank read, decoded and trained in one epoch, logged at the epoch's last step as
    `data/<rank>/<count>` and, summed over the ranks, as `data/<count>`."""

    BYTES_READ = "bytes_read"  # as the store served them, parquet footers included
    ROWS_DECODED = "rows_decoded"  # rows of the row groups read
    ROWS_TRAINED = "rows_trained"


VAL_PREFIX = "val/"
WORKER_PREFIX = "worker/"
GPU_PREFIX = "gpu/"
DATA_PREFIX = "data/"


def is_per_rank(name: str) -> bool:
    """A metric one rank logs about itself (`worker/3/busy_s`, `gpu/0/power_w`, `data/1/bytes_read`)."""
    prefix, _, rest = name.partition("/")
    return f"{prefix}/" in (WORKER_PREFIX, GPU_PREFIX, DATA_PREFIX) and rest.split("/", 1)[0].isdigit()


def worker_metric(rank: int, value: WorkerValue) -> str:
    return f"{WORKER_PREFIX}{rank}/{value}"


def checkpoint_phase_metric(phase: str) -> str:
    """Seconds a step's checkpointing held the training thread in one phase (`saver.py`):
    `time/checkpoint/staging_s`, ...; `time/checkpoint_s` is their sum."""
    return f"time/checkpoint/{phase}_s"


def gpu_metric(rank: int, reading: GpuReading) -> str:
    return f"{GPU_PREFIX}{rank}/{reading}"


# Beyond `monitor.per_rank_up_to` ranks, a per-rank value is logged as its spread across the
# ranks: `worker/busy_s/min`, `.../median`, `.../max` and `.../max_rank` (the rank with the max).
ACROSS_RANKS = ("min", "median", "max", "max_rank")


def across_ranks(series: str, stat: str) -> str:
    """`worker/busy_s` + `max` -> `worker/busy_s/max`."""
    return f"{series}/{stat}"


def data_metric(count: DataCount, rank: int | None = None) -> str:
    """`data/<rank>/<count>` for one rank's count, `data/<count>` for the sum over the ranks."""
    return f"{DATA_PREFIX}{count}" if rank is None else f"{DATA_PREFIX}{rank}/{count}"


def eval_metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """The evaluation results (`val/...`) among `values` (an eval event's fields, metrics)."""
    return {key: value for key, value in values.items() if key.startswith(VAL_PREFIX)}


TRAIN_PREFIX = "train/"
MODEL_METRIC_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-. /")


def model_metric(prefix: str, name: str) -> str:
    """A metric the model returned (a 0-dim entry of its output) as logged: `train/<name>`
    in training, `val/<name>` in evaluation."""
    return f"{prefix}{name}"


def model_metric_problem(name: str, task: str) -> str | None:
    """Why a model may not return a metric of this name (it would overwrite one of shoal's
    own, or MLflow refuses the name), or None."""
    if not name or not set(name) <= MODEL_METRIC_CHARACTERS:
        return f"metric name {name!r} must be letters, digits and _ - . / or spaces"
    own = {m.value for m in Metric}
    taken = [p + name for p in (TRAIN_PREFIX, VAL_PREFIX) if p + name in own]
    if taken == [Metric.VAL_ACCURACY.value] and task != "classify":
        return None  # shoal measures accuracy for classify only: the model's own is welcome
    if taken:
        return f"metric name {name!r} is shoal's own ({', '.join(taken)}); rename it"
    return None


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """Keys as plain str: a Metric key would otherwise cross Ray as shoal's enum."""
    return {str(key): value for key, value in values.items()}


@dataclass
class StepRecord:
    """One optimizer step's metrics, as the workers measured them."""

    step: int
    time: float | None = None  # when the step ended (the points' MLflow timestamp); None: when logged
    values: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "time": self.time, **_plain(self.values)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        values = {key: value for key, value in data.items() if key not in ("step", "time")}
        return cls(int(data["step"]), data.get("time"), values)


@dataclass
class Event:
    """Something that happened, with its own fields (a straggler's rank, a failure's errors...)."""

    kind: EventKind
    time: float = field(default_factory=time.time)
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kind = EventKind(self.kind)
        if "kind" in self.fields or "time" in self.fields:
            raise ValueError(f"an event's fields cannot be named kind or time: {sorted(self.fields)}")

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "time": self.time, **_plain(self.fields)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        fields = {key: value for key, value in data.items() if key not in ("kind", "time")}
        return cls(EventKind(data["kind"]), data["time"], fields)


@dataclass
class ReportSummary:
    """Where training stands, sent with every report."""

    step: int
    epoch: int
    samples: int
    world_size: int
    total_steps: int
    final: bool = False  # the last report of a finished run
    fatal: str | None = None  # why the run cannot go on (also sent as a fatal event)
    score: float | None = None  # checkpoint.keep_best's metric at its latest evaluation
    checkpointed: bool = False  # this report hands a checkpoint to Ray

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReportSummary:
        return cls(**data)

    @classmethod
    def coerce(cls, summary: ReportSummary | Mapping[str, Any]) -> ReportSummary:
        return summary if isinstance(summary, ReportSummary) else cls.from_dict(summary)


@dataclass
class ProfileTrace:
    """A rank's gzipped torch.profiler trace of a window of steps."""

    rank: int
    name: str  # the file's name, e.g. rank0.steps3-4.pt.trace.json.gz
    first_step: int
    last_step: int
    data: str | None = None  # base64 of the file, when small enough to travel in a report
    path: str | None = None  # where it stayed on the worker's node, when too big

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileTrace:
        return cls(**data)

    def event(self, at: float | None = None) -> Event:
        """The profile event the driver records once it has the trace (without its data)."""
        fields = {key: value for key, value in self.to_dict().items() if key != "data"}
        return Event(EventKind.PROFILE, time.time() if at is None else at, fields)


# The keys of a worker report's own parts among ray.train.report's metrics.
STEPS_KEY, EVENTS_KEY, PROFILES_KEY = "shoal_steps", "shoal_events", "shoal_profiles"
_OWN_PREFIX = "shoal_"


@dataclass
class WorkerReport:
    """What one rank passes to `ray.train.report` as its metrics (Ray Train's `_TrainingReport`
    adds the checkpoint). Rank 0 sends the steps and events (every rank holds the same), the
    others their summary alone; profiles are each rank's own."""

    summary: ReportSummary
    steps: list[StepRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    profiles: list[ProfileTrace] = field(default_factory=list)

    def to_metrics(self) -> dict[str, Any]:
        metrics = {
            **self.summary.to_dict(),
            STEPS_KEY: [record.to_dict() for record in self.steps],
            EVENTS_KEY: [event.to_dict() for event in self.events],
        }
        if self.profiles:
            metrics[PROFILES_KEY] = [trace.to_dict() for trace in self.profiles]
        return metrics

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> WorkerReport:
        summary = {key: value for key, value in metrics.items() if not key.startswith(_OWN_PREFIX)}
        return cls(
            ReportSummary.from_dict(summary),
            [StepRecord.from_dict(record) for record in metrics.get(STEPS_KEY, [])],
            [Event.from_dict(event) for event in metrics.get(EVENTS_KEY, [])],
            [ProfileTrace.from_dict(trace) for trace in metrics.get(PROFILES_KEY, [])],
        )


@dataclass
class RecentRecords:
    """The step records and evaluations since the last checkpoint, kept in the next one
    (trainer_state.json's `recent`), so that a driver killed before it logged them gets
    them again from the restored attempt."""

    steps: list[StepRecord] = field(default_factory=list)
    evals: list[Event] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        return {
            "steps": [record.to_dict() for record in self.steps],
            "evals": [event.to_dict() for event in self.evals],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecentRecords:
        return cls(
            [StepRecord.from_dict(record) for record in data["steps"]],
            [Event.from_dict(event) for event in data["evals"]],
        )
