"""The training loop each Ray Train worker runs: `train(config)`.

Everything arrives typed in a `WorkerConfig` (the validated workload and the
run's facts); everything the loop asks of the cluster goes through a
`TrainContext` (`context.py`). The trainer is a handful of named parts (engine,
training state, checkpointer, reporter, watchdog) and one loop.
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from shoal.data.manifest import Manifest
from shoal.data.reader import ReadCounts
from shoal.errors import ShoalError
from shoal.messages import (
    TRAIN_PREFIX,
    EventKind,
    LoopOutcome,
    Metric,
    ProfileTrace,
    ReportSummary,
    StepRecord,
    WorkerValue,
    model_metric,
)
from shoal.models.cost import batch_shapes, trace_cost
from shoal.worker.batching import accumulation_steps, global_batch_size, planned_steps
from shoal.worker.checkpoint.saver import Checkpointer
from shoal.worker.checkpoint.state import Position, TrainingState
from shoal.worker.config import WorkerConfig
from shoal.worker.context import RayTrainContext, TrainContext
from shoal.worker.engine import Engine, StepLoss
from shoal.worker.links import LinkProbe, parse_address
from shoal.worker.metrics import (
    GpuReadings,
    PeakMemory,
    PhaseClock,
    RankWatch,
    device_name,
    read_counts_per_rank,
)
from shoal.worker.parallel.stats_ride import StatsRide
from shoal.worker.profiling import ProfileWindow
from shoal.worker.reporting import MetricNamesError, Reporter, SharedStats, StepStats
from shoal.worker.runtime import HangWatchdog, SampleAudit, pick_device, seed_everything, write_pid_file
from shoal.worker.step_record import Stalls, StepTiming, step_values, tokens_per_s
from shoal.worker.steps import ValidationShare, evaluate
from shoal.worker.stream import StreamPlan, micro_batches, optimizer_steps, timed


class Trainer:
    """A worker's loop around the Engine: data, checkpoints, reports, watchdog."""

    def __init__(self, config: WorkerConfig, context: TrainContext):
        workload = config.workload
        self.config, self.workload, self.context = config, workload, context
        self.rank, self.world = context.world_rank, context.world_size
        self.task, self.failure = config.task, workload.failure
        self.micro = workload.data.batch_size
        self.global_batch = global_batch_size(workload)
        self.accum = accumulation_steps(self.global_batch, self.micro, self.world)
        self.manifest = Manifest.from_json(config.train_manifest)
        self.total_steps = planned_steps(workload.train, self.manifest.total_rows, self.global_batch)
        self.read_counts = ReadCounts()  # this rank's reading in the current epoch
        self.device = pick_device(context.local_rank)
        self.engine = Engine(
            workload,
            self.task,
            self.world,
            self.device,
            self.total_steps,
            self.accum,
            compile_cache=os.path.join(config.run_dir, "compile_cache"),
        )
        self.training = TrainingState(
            self.world, self.global_batch, self.manifest.digest, workload.data.accept_changed_data
        )
        self.last_loss = math.nan
        self.last_eval: dict[str, float] = {}
        self.reporter = Reporter(StepStats(self.world, config.report_interval_s, self.rank), context)
        monitor = workload.monitor
        self.clock, self.gpu = PhaseClock(self.device), GpuReadings(self.device)
        self.peak_memory = PeakMemory(self.device)
        self.ranks = RankWatch(monitor)
        head = context.head_address if self.world > 1 else None  # one rank has no others to compare
        self.link_probe = LinkProbe(
            head and parse_address(head), monitor.stragglers.link_probe_every_s
        ).start()
        self.profile = ProfileWindow(monitor.profile, self.rank, self.device, config.run_dir)
        self.flops_per_step: float | None = None
        self.stalls = Stalls()
        self.checkpointer = Checkpointer(
            self.engine,
            self.training,
            context,
            self.reporter,
            workload.checkpoint,
            config.init_from,
            config.own_latest,
        )
        self.watchdog = HangWatchdog(self.failure.hang_timeout_s, config.run_dir, self.rank)
        self.audit = SampleAudit(config.run_dir, self.rank) if config.audit_samples else None
        self.validation = (
            ValidationShare(
                config.val_manifest, self.engine, self.micro, workload.train.eval_batches, config.keep_val
            )
            if config.val_manifest
            else None
        )

    @property
    def position(self) -> Position:
        return self.training.position

    # -- checkpoints -------------------------------------------------------------
    def restore(self, reason: str = "start") -> None:
        restored = self.checkpointer.restore()
        if restored is not None:  # the driver logs only what it has not logged yet
            self.reporter.steps = [*self.training.recent.steps, *self.reporter.steps]
            self.reporter.events += self.training.recent.evals
            if restored.from_init:  # PBT: this trial's own settings
                self.engine.apply_optimizer_settings(self.workload.train.optimizer)
        if restored is None or not restored.rng_restored:  # a rank new to the run gets its own seed
            seed_everything(self.workload.train.seed * 7919 + self.rank + 1000 * self.position.step)
        old_world = restored.previous_world if restored else self.world
        if restored is not None and old_world != self.world:
            self.reporter.event(
                EventKind.RESIZED,
                step=self.position.step,
                previous_world_size=old_world,
                world_size=self.world,
            )
        self.reporter.event(
            EventKind.ATTEMPT_STARTED if reason == "start" else EventKind.ROLLED_BACK,
            world_size=self.world,
            restored_step=self.position.step if restored else None,
            restored_from=restored.source if restored else None,
            previous_world_size=old_world if restored else None,
            parameters=self.engine.parameters,
            accumulation=self.accum,
            global_batch=self.global_batch,
            total_steps=self.total_steps,
            device=str(self.device),
            device_name=device_name(self.device),
            parallel=self.engine.describe(),
        )

    # -- steps -------------------------------------------------------------------
    def _summary(self, final: bool = False, fatal: str | None = None) -> ReportSummary:
        keep_best, score = self.workload.checkpoint.keep_best, None
        if keep_best and keep_best.metric in self.last_eval:  # the driver keeps the best checkpoint
            score = self.last_eval[keep_best.metric]
        p = self.position
        return ReportSummary(p.step, p.epoch, p.samples, self.world, self.total_steps, final, fatal, score)

    def _evaluate(self) -> None:
        if self.validation is not None:
            batches = self.validation.batches()
            if self.audit and self.rank == self.engine.mp_ranks[0]:  # one rank per data-parallel slot
                batches = self.audit.evaluated(self.position.step, batches, *self.engine.data_slot())
            fillers = self.validation.fillers()
            results = evaluate(self.engine, batches, self.task, self.world, fillers)
        else:
            results = {}
        self.last_eval = {**results, Metric.TRAIN_LOSS: self.last_loss}
        if results:
            self.training.recent.evals.append(
                self.reporter.event(EventKind.EVAL, step=self.position.step, **results)
            )

    def _stream(self) -> Iterator[Any]:
        plan = StreamPlan(
            micro=self.micro,
            per_step=self.global_batch // self.micro,
            rank=self.rank,
            world=self.world,
            epochs=self.workload.train.epochs,
            shuffle_buffer=self.workload.data.shuffle_buffer,
            seed=self.workload.train.seed,
            skipped_steps=set(self.training.skipped_steps),
        )
        return micro_batches(self.manifest, plan, self.position, self.read_counts)

    def run(self) -> None:
        try:
            self.restore()
        except ShoalError as exc:  # a checkpoint of another global batch or other data: no retry helps
            self._fail("; ".join(exc.lines()))
            return
        self.reporter.send(self._summary())
        if self.failure.on_nan == "rollback" and self.position.step == 0:
            self.checkpointer.save(self._summary())  # something to roll back to before the first checkpoint
        while self.position.step < self.total_steps:
            outcome = self._train_stream()
            if outcome == LoopOutcome.ROLLBACK:
                self.checkpointer.finish_pending()
                self.restore(reason="rollback")
                if self.audit:
                    self.audit.new_lineage()
                self.reporter.send(self._summary())
            elif outcome in (LoopOutcome.DONE, LoopOutcome.FATAL):
                break
            else:  # the data ran out (epochs mode) before the planned step count
                self._evaluate()
                self.checkpointer.save(self._summary(final=True), final=True)
                break
        else:
            self.reporter.send(self._summary(final=True))
        self.watchdog.disarm()
        self.link_probe.stop()
        self.checkpointer.close()

    def _train_stream(self) -> LoopOutcome:
        """Train from the current position until done, a NaN rollback, a fatal error or the data's end."""
        self.watchdog.arm()
        self.step_started, self.data_wait = time.perf_counter(), 0.0
        for group in optimizer_steps(timed(self._stream(), self._waited_for_data), self.accum):
            outcome = self._train_step(group)
            if outcome is not None:
                return outcome
        return LoopOutcome.EXHAUSTED

    def _train_step(self, group: list[Any]) -> LoopOutcome | None:
        """One optimizer step over this rank's micro-batches; an outcome when the stream must stop."""
        per_step = self.global_batch // self.micro
        self.profile.before_step(self.position.step + 1)
        batches = [self.engine.combine(i.batch) for i in group]
        if self.flops_per_step is None:
            self.flops_per_step = self._flops_per_step(batches[0])
        timer, shared = time.perf_counter(), []
        # On CPU the step's numbers go to the other ranks with the last backward pass (the
        # all-reduce's wait was a quarter of a small model's step on 2 workers), inside DDP's
        # gradient all-reduce where it can (parallel/stats_ride.py); on GPUs reading the loss
        # before the backward pass would stall the device's queue.
        share_early = self.device.type == "cpu" and self.world > 1

        def share(loss: StepLoss) -> None:
            shared.append(self._share(loss, self.clock.seconds, self.engine.stats_ride))

        try:
            local = self.engine.forward_backward(batches, self.clock, share if share_early else None)
            self.clock.add("forward_backward", time.perf_counter() - timer)
            phases = self.clock.take()
            reduced = self.reporter.stats.finish(shared[0] if shared else self._share(local, phases))
        except MetricNamesError as exc:  # raised on every rank alike: all stop together
            self._fail(str(exc))
            return LoopOutcome.FATAL
        loss, gathered = reduced.loss, reduced.per_rank
        if reduced.written and self.checkpointer.pending is not None:
            self.checkpointer.finish_pending()
            self.stalls.add_checkpoint(self.checkpointer.take_blocked())
        last = group[-1]
        self.position.epoch = last.epoch
        self.position.batches_in_epoch = (last.index // per_step + 1) * per_step
        self.position.samples += self.global_batch
        if not math.isfinite(loss):
            outcome = self._non_finite(loss, last.epoch, last.index // per_step)
            self.step_started = time.perf_counter()
            return None if outcome == LoopOutcome.SKIP else outcome
        timer = time.perf_counter()
        self.engine.optimizer_step()
        phases["optimizer"] = time.perf_counter() - timer
        self.position.step += 1
        self.last_loss = loss
        if self.audit:
            self.audit.record(self.position.step, last.epoch, group)
        elapsed, self.step_started = time.perf_counter() - self.step_started, time.perf_counter()
        self._record(loss, elapsed, self.engine.objective.predicted_tokens(last.batch), phases, gathered)
        if last.last_of_epoch:
            self.reporter.steps[-1].values.update(self.ranks.epoch_metrics(gathered))
        self._record_model_metrics(reduced.metrics)
        return self._after_step(reduced.report_due)

    def _share(self, local: StepLoss, phases: dict[str, float], ride: StatsRide | None = None) -> SharedStats:
        """Start the step's all-reduce (or give it to the coming backward pass's `ride`):
        loss, decisions and every rank's own values."""
        per_rank = {
            WorkerValue.BUSY_S: self.data_wait + phases.get("forward", 0.0),
            "peak_mb": self.peak_memory.read(),
            **self.gpu.read(),
            **self.link_probe.per_rank(),
            **read_counts_per_rank(self.read_counts),
        }
        written = self.checkpointer.written_here()
        return self.reporter.stats.start(local.loss, local.weight, written, per_rank, local.metrics, ride)

    def _after_step(self, report_due: bool) -> LoopOutcome | None:
        """Profile, evaluate, checkpoint or report as due; DONE after the last step."""
        step, done = self.position.step, self.position.step >= self.total_steps
        if trace := self.profile.after_step(step):
            self.reporter.profiles.append(ProfileTrace.from_dict(trace))
        every_eval = self.workload.train.eval_every
        if done or (every_eval and step % every_eval == 0):
            started = time.perf_counter()
            self._evaluate()
            self.stalls.add(Metric.TIME_EVAL_S, time.perf_counter() - started)  # part of the next step
        self.watchdog.arm()
        if self.checkpointer.due(step, done):  # the summary goes to the driver with the checkpoint
            self.checkpointer.save(self._summary(final=done), final=done)
            self.stalls.add_checkpoint(self.checkpointer.take_blocked())
        elif report_due or self.reporter.events or self.reporter.profiles:
            started = time.perf_counter()
            self.reporter.send(self._summary())  # a barrier across the ranks: its time is measured
            self.stalls.add(Metric.TIME_REPORT_S, time.perf_counter() - started)
        self.watchdog.arm()
        return LoopOutcome.DONE if done else None

    def _non_finite(self, loss: float, epoch: int, step_in_epoch: int) -> LoopOutcome:
        """failure.on_nan: 'fail' stops the run, 'skip' drops this step's update, 'rollback'
        restores the last checkpoint and leaves this step's batch out from then on."""
        policy, step = self.failure.on_nan, self.position.step + 1
        self.engine.discard_gradients()
        self.training.nan_steps += 1
        limit = self.failure.max_nan_steps
        if policy == "fail" or self.training.nan_steps > limit:
            why = "failure.on_nan: fail" if policy == "fail" else f"more than failure.max_nan_steps ({limit})"
            self._fail(f"training loss is {loss} at step {step} ({why})")
            return LoopOutcome.FATAL
        self.training.skipped_steps.add((epoch, step_in_epoch))
        self.reporter.event(
            EventKind.for_nan_policy(policy),
            step=step,
            epoch=epoch,
            step_in_epoch=step_in_epoch,
            loss=str(loss),
        )
        return LoopOutcome(policy)

    def _waited_for_data(self, seconds: float) -> None:
        self.data_wait += seconds

    def _flops_per_step(self, batch: dict[str, torch.Tensor]) -> float:
        """Model FLOPs of one optimizer step (every rank's share), traced once on meta."""
        try:
            model = Engine.model_config(self.workload)
            cost = trace_cost(model, self.engine.objective, batch_shapes(batch))
        except Exception as exc:  # a user model that cannot be built on meta: no FLOP metrics
            self.reporter.event(EventKind.FLOPS_UNAVAILABLE, reason=f"{type(exc).__name__}: {exc}"[:300])
            return 0.0
        return cost.flops_per_sample * self.global_batch

    def _record(
        self,
        loss: float,
        elapsed: float,
        predicted_per_sample: int,
        phases: dict[str, float],
        gathered: dict[str, list[float]],
    ) -> None:
        for event in self.ranks.observe(self.position.step, gathered):
            self.reporter.event(event.pop("kind"), **event)
        timing = StepTiming(elapsed, self.data_wait, phases)
        samples = self.global_batch
        values = {
            **step_values(self.engine, loss, timing, samples, self.world, self.flops_per_step),
            Metric.TRAIN_EPOCH: self.position.epoch,
            **self.stalls.take(),
            **self.ranks.step_metrics(gathered, self.gpu.available),
        }
        if self.task == "lm":
            values.update(tokens_per_s(samples, predicted_per_sample, elapsed, self.world))
        # Its time is when the step ended: MLflow's timestamp for this step's points.
        record = StepRecord(self.position.step, time.time(), values)
        self.training.recent.steps.append(self.reporter.record_step(record))
        self.data_wait = 0.0

    def _record_model_metrics(self, metrics: dict[str, float]) -> None:
        """The model's own metrics beside shoal's in this step's record (names that are
        shoal's own are refused before launch; shoal's value wins if one slips through)."""
        record = self.reporter.steps[-1]
        for name, value in metrics.items():
            record.values.setdefault(model_metric(TRAIN_PREFIX, name), value)

    def _fail(self, reason: str) -> None:
        """A failure that a restart cannot fix: tell the driver, then stop cleanly."""
        self.watchdog.disarm()
        self.reporter.event(EventKind.FATAL, reason=reason, step=self.position.step)
        self.reporter.send(self._summary(fatal=reason))


def train(loop_config: dict[str, Any]) -> None:
    """Entry point for `TorchTrainer(train_loop_per_worker=...)`."""
    config = WorkerConfig.from_train_loop_config(loop_config)
    for path in config.sys_path:
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(config.threads_per_worker)
    context = RayTrainContext()
    attempt = os.environ.get("SHOAL_ATTEMPT", uuid.uuid4().hex[:8])
    write_pid_file(config.run_dir, context.world_rank, attempt_id=attempt)
    Trainer(config, context).run()
