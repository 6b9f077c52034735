"""Turns worker reports into MLflow records (and progress for the terminal).

Runs on the driver. Step metrics are logged at their step number exactly once:
after a restart, steps up to the highest one already logged are replayed by the
workers but not logged again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shoal.messages import Event, EventKind, Metric, ProfileTrace, ReportSummary, StepRecord, eval_metrics
from shoal.plan.catalog import gpu_for_device
from shoal.queue_messages import FailureMessage, ReportMessage
from shoal.tracking.artifacts import PLOTTED, TensorBoard, plot_run, save_trace
from shoal.tracking.mlflow_run import TrackedRun, ended_tag

EVENTS_FILE = "events.json"  # the run's events, an MLflow artifact
FLUSH_AT_END_S = 300.0  # how long the end of a run waits for an unreachable MLflow
log = logging.getLogger("shoal")


class Observer(Protocol):
    def on_progress(self, step: int, total: int, metrics: dict[str, float]) -> None: ...
    def on_event(self, event: Event) -> None: ...
    def on_checkpoint(self, path: str, step: int) -> None: ...


@dataclass
class RunState:
    step: int = 0
    total_steps: int = 0
    world_size: int = 0
    attempts: int = 0
    restarts: int = 0
    latest: dict[str, float] = field(default_factory=dict)
    evals: dict[str, float] = field(default_factory=dict)
    checkpoints: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    fatal: str | None = None
    finished: bool = False


class Recorder:
    def __init__(
        self,
        run: TrackedRun,
        observer: Observer | None = None,
        run_dir: Path | None = None,
        tensorboard: bool = False,
    ):
        self.run, self.observer, self.run_dir = run, observer, run_dir
        self.state = RunState()
        self.peak_flops: float | None = None  # of all the job's GPUs, when the catalog knows them
        self.tensorboard = TensorBoard(run_dir / "tensorboard") if tensorboard and run_dir else None
        self.logged_until = run.logged_until
        self.logged_evals: set[int] = set()
        self.earlier_events = 0  # events recorded by earlier drivers of a resumed job
        self.untold: list[Callable[[Observer], None]] = []  # observer calls, made once written
        if run.resumed:
            history = run.client.get_metric_history(run.run_id, Metric.VAL_LOSS.value)
            self.logged_evals = {m.step for m in history}
            self._continue_history()
            self._tell_observer()

    def _continue_history(self) -> None:
        """A resumed job goes on with the events and attempt counts its earlier drivers recorded."""
        tags = self.run.client.get_run(self.run.run_id).data.tags
        self.state.attempts = int(tags.get("shoal.attempts", 0))
        self.state.restarts = int(tags.get("shoal.restarts", 0))
        self.state.events = [Event.from_dict(e) for e in self.run.read_json(EVENTS_FILE) or []]
        self.earlier_events = len(self.state.events)
        self._event(Event(EventKind.JOB_RESUMED, fields={"previous_attempts": self.state.attempts}))

    def handle(self, message: ReportMessage | FailureMessage) -> None:
        """Writes the message to MLflow, then tells the observer: a sweep's scheduler may end
        the trial as soon as it hears of an evaluation, and what came with it must be written."""
        try:
            if isinstance(message, FailureMessage):
                self._event(message.event())
            else:
                self._record(message)
        finally:  # what was written, even if a later write raised; nothing left for the next message
            self._tell_observer()

    def _record(self, message: ReportMessage) -> None:
        summary = message.summary
        self.state.step = summary.step
        self.state.total_steps = summary.total_steps
        self.state.world_size = summary.world_size
        for event in message.events:
            self._event(event)
        self._log_steps(message.steps)
        for trace in message.profiles:
            self._extra("the profiler trace", self._trace, trace)
        if message.checkpoint:
            self._checkpoint(message.checkpoint, summary)
        if summary.fatal:
            self.state.fatal = summary.fatal
        if summary.final:
            self.state.finished = True
        step, total = self.state.step, self.state.total_steps
        progress = {**self.state.latest, **self.state.evals}
        self.untold.append(lambda observer: observer.on_progress(step, total, progress))

    def _tell_observer(self) -> None:
        told, self.untold = self.untold, []
        if self.observer:
            for call in told:
                call(self.observer)

    def _log_steps(self, steps: list[StepRecord]) -> None:
        rows = []
        for record in steps:
            values = dict(record.values)
            if self.peak_flops and Metric.PERF_TFLOPS in values:
                values[Metric.PERF_MFU.value] = values[Metric.PERF_TFLOPS] * 1e12 / self.peak_flops
            self.state.latest = values
            if record.step <= self.logged_until:
                continue
            rows += [(key, value, record.step, record.time) for key, value in values.items()]
            self.logged_until = record.step
        self._log_rows(rows)

    def _log_rows(self, rows: list[tuple[str, float, int, float | None]]) -> None:
        if not rows:
            return
        self.run.log_metrics(rows)
        if self.tensorboard:
            self.tensorboard.scalars(rows)

    def _event(self, event: Event) -> None:
        if event.kind == EventKind.EVAL:
            step = event.fields["step"]
            values = eval_metrics(event.fields)
            self.state.evals = values
            if step not in self.logged_evals:
                self._log_rows([(k, v, step, event.time) for k, v in values.items()])
                self.logged_evals.add(step)
            self.untold.append(lambda observer: observer.on_event(event))
            return
        self.state.events.append(event)
        if event.kind == EventKind.ATTEMPT_STARTED:
            self._attempt(event)
        self.run.log_json([e.to_dict() for e in self.state.events], EVENTS_FILE)
        self.untold.append(lambda observer: observer.on_event(event))

    def _attempt(self, event: Event) -> None:
        gpu = gpu_for_device(event.get("device_name") or "")
        precision = (event.get("parallel") or {}).get("precision", "fp32")
        self.peak_flops = gpu.peak_flops(precision) * event.fields["world_size"] if gpu else None
        self.state.attempts += 1
        if self.state.attempts > 1:
            self.state.restarts += 1
        tags = {
            "shoal.attempts": self.state.attempts,
            "shoal.restarts": self.state.restarts,
            "shoal.world_size": event.fields["world_size"],
            "shoal.parameters": event.get("parameters"),
            "shoal.device": event.get("device"),
            "shoal.device_name": event.get("device_name"),
        }
        self.run.set_tags(tags)
        restored = event.get("restored_step")
        self.run.log_metrics([(Metric.ATTEMPT.value, float(self.state.attempts), restored or 0, event.time)])

    def _checkpoint(self, path: str, summary: ReportSummary) -> None:
        self.state.checkpoints.append(path)
        step = summary.step
        self.run.set_tags({"shoal.latest_checkpoint": path, "shoal.latest_checkpoint_step": step})
        self.untold.append(lambda observer: observer.on_checkpoint(path, step))

    def _trace(self, trace: ProfileTrace) -> None:
        """A worker's profiler trace -> MLflow artifacts `profiles/` (and TensorBoard)."""
        if self.run_dir is None:
            return
        path = save_trace(trace, self.run_dir / "profiles")
        if path is None:
            log.warning("rank %s's trace stayed on its node at %s", trace.rank, trace.path)
            return
        self.run.log_artifact(str(path), "profiles")
        if self.tensorboard:
            self.tensorboard.trace(path)
        self._event(trace.event())

    @staticmethod
    def _extra(what: str, action: Any, *args: Any) -> None:
        """Extras (plots, traces, TensorBoard files) are written under the run directory;
        failing to write them (a full disk) must not fail the run or lose its metrics."""
        try:
            action(*args)
        except Exception as exc:
            log.warning("could not write %s: %s: %s", what, type(exc).__name__, exc)

    def _plot(self) -> None:
        """The loss/throughput plot over the whole run (earlier drivers' steps included), read
        back from MLflow once every buffered write has been sent."""
        if self.run_dir is None:
            return
        history = {key: self.run.client.get_metric_history(self.run.run_id, key.value) for key in PLOTTED}
        series = {key: [(m.step, m.value) for m in points] for key, points in history.items()}
        path = plot_run(series, self.run_dir.name, self.run_dir / "plots" / "training.png")
        if path is not None:
            self.run.log_artifact(str(path), "plots")

    def finish(self, status: str) -> int:
        """Close the run; the number of writes MLflow never took (0 when all were sent).
        Waits up to FLUSH_AT_END_S for an unreachable store; without it, no plot."""
        self.run.set_tags(ended_tag())
        reachable = self.run.flush_within(FLUSH_AT_END_S)
        if reachable:
            self._extra("the plot", self._plot)
        if self.tensorboard:
            self._extra("the TensorBoard files", self.tensorboard.close)
            self.run.log_artifact(str(self.tensorboard.logdir), "tensorboard")
        self.run.set_tags({"shoal.buffered_writes": self.run.buffered_total})
        self.run.finish(status)
        if not self.run.flush_within(FLUSH_AT_END_S if reachable else 0):
            log.error("MLflow at %s: %d writes could not be sent", self.run.uri, len(self.run.pending))
        return len(self.run.pending)
