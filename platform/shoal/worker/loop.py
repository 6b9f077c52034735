"""The training loop each Ray Train worker runs: `train(config)`.

Everything arrives in `config` (plain data from the driver): the resolved
workload, the data plan, the run directory. The trainer is a handful of named
parts (model, optimizer, scheduler, batches, reporter, watchdog) and one loop.
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shoal.models.cost import batch_shapes, trace_cost
from shoal.worker.batching import accumulation_steps, global_batch_size, planned_steps
from shoal.worker.checkpoint import Position
from shoal.worker.checkpointing import Checkpointer
from shoal.worker.engine import Engine
from shoal.worker.metrics import (
    GpuReadings,
    PhaseClock,
    StragglerWatch,
    device_name,
    peak_memory_mb,
    worker_metrics,
)
from shoal.worker.profiling import ProfileWindow
from shoal.worker.reporting import Reporter, StepStats
from shoal.worker.runtime import HangWatchdog, SampleAudit, pick_device, seed_everything, write_pid_file
from shoal.worker.steps import evaluate
from shoal.worker.stream import StreamPlan, micro_batches


class Trainer:
    """A Ray Train worker's loop around the Engine: data, checkpoints, reports, watchdog."""

    def __init__(self, config: dict[str, Any]):
        import ray.train

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.config, self.spec = config, config["workload"]
        self.train_spec, self.task = self.spec["train"], config["data"]["task"]
        self.failure = self.spec["failure"]
        self.micro = self.spec["data"]["batch_size"]
        self.global_batch = global_batch_size(self.spec)
        self.accum = accumulation_steps(self.global_batch, self.micro, self.world)
        self.total_steps = planned_steps(self.train_spec, config.get("train_rows"), self.global_batch)
        self.device = pick_device(context.get_local_rank())
        self.engine = Engine(
            self.spec,
            self.task,
            self.world,
            self.device,
            self.total_steps,
            self.accum,
            compile_cache=str(Path(config["run_dir"]) / "compile_cache"),
        )
        self.position = Position()
        self.saved_step = -1
        self.skipped_steps: set[tuple[int, int]] = set()  # (epoch, step in epoch) left out after a NaN
        self.nan_steps = 0
        self.last_loss = math.nan
        self.last_eval: dict[str, float] = {}
        # What was recorded since the last checkpoint goes into the next one, so that a driver
        # killed before it logged them gets them again from the restored attempt.
        self.unsaved: dict[str, list] = {"steps": [], "evals": []}
        self.reporter = Reporter(StepStats(self.world, config["report_interval_s"], self.rank))
        monitor = self.spec["monitor"]
        self.clock, self.gpu = PhaseClock(self.device), GpuReadings(self.device)
        self.stragglers = StragglerWatch(**monitor["stragglers"])
        self.profile = ProfileWindow(monitor["profile"], self.rank, self.device, config["run_dir"])
        self.flops_per_step: float | None = None
        self.stalls: dict[str, float] = {"checkpoint": 0.0, "eval": 0.0}  # between steps
        background = self.spec["checkpoint"]["async"]
        self.checkpointer = Checkpointer(
            self.engine, self.rank, background, self.reporter, config.get("init_from")
        )
        self.watchdog = HangWatchdog(self.failure["hang_timeout_s"], config["run_dir"], self.rank)
        self.audit = SampleAudit(config["run_dir"], self.rank) if config.get("audit_samples") else None

    # -- checkpoints -------------------------------------------------------------
    def restore(self, reason: str = "start") -> None:
        restored = self.checkpointer.restore()
        restored_from, old_world = None, self.world
        if restored is not None:
            state = restored.state
            self.position, old_world = Position(**state["position"]), state["world_size"]
            if state["global_batch"] != self.global_batch:
                raise ValueError(
                    f"the checkpoint was trained with a global batch of {state['global_batch']} rows, "
                    f"this workload asks for {self.global_batch}"
                )
            self.skipped_steps |= {tuple(s) for s in state["skipped_steps"]}
            self.nan_steps = max(self.nan_steps, state["nan_steps"])
            recent = state["recent"]  # the driver logs only what it has not logged yet
            self.reporter.steps = [*recent["steps"], *self.reporter.steps]
            self.reporter.events += recent["evals"]
            self.unsaved = {"steps": list(recent["steps"]), "evals": list(recent["evals"])}
            restored_from = self.saved_step = self.position.step
            if restored.source == self.config.get("init_from"):  # PBT: this trial's own settings
                self.engine.apply_optimizer_settings(self.train_spec["optimizer"])
        if restored is None or not restored.rng_restored:  # a rank new to the run gets its own seed
            seed_everything(self.train_spec["seed"] * 7919 + self.rank + 1000 * self.position.step)
        if restored is not None and old_world != self.world:
            self.reporter.event(
                "resized", step=self.position.step, previous_world_size=old_world, world_size=self.world
            )
        self.reporter.event(
            "attempt_started" if reason == "start" else "rolled_back",
            world_size=self.world,
            restored_step=restored_from,
            restored_from=restored.source if restored else None,
            previous_world_size=old_world if restored_from is not None else None,
            parameters=self.engine.parameters,
            accumulation=self.accum,
            global_batch=self.global_batch,
            total_steps=self.total_steps,
            device=str(self.device),
            device_name=device_name(self.device),
            parallel=self.engine.describe(),
        )

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "position": asdict(self.position),
            "world_size": self.world,
            "global_batch": self.global_batch,
            "scheduler": self.engine.schedulers[0].state_dict(),
            "skipped_steps": sorted(self.skipped_steps),
            "nan_steps": self.nan_steps,
            "recent": self.unsaved,
        }

    def save(self, final: bool = False) -> None:
        if self.position.step == self.saved_step:  # nothing new since the last checkpoint
            self.checkpointer.finish_pending()
            self.reporter.send(self._summary(final=final))
            return
        self.saved_step = self.position.step
        summary = self._summary(final=final)
        name = f"checkpoint-{self.position.step:08d}"
        self.checkpointer.save(name, self._trainer_state(), summary)
        self.unsaved = {"steps": [], "evals": []}
        if final:
            self.checkpointer.finish_pending()

    # -- steps -------------------------------------------------------------------
    def _summary(self, **extra: Any) -> dict[str, Any]:
        summary = {
            "step": self.position.step,
            "epoch": self.position.epoch,
            "samples": self.position.samples,
            "world_size": self.world,
            "total_steps": self.total_steps,
            **extra,
        }
        keep_best = self.spec["checkpoint"]["keep_best"]
        if keep_best and keep_best["metric"] in self.last_eval:  # the driver keeps the best checkpoint
            summary["score"] = self.last_eval[keep_best["metric"]]
        return summary

    def _evaluate(self) -> None:
        import ray.train

        if self.config["data"]["val"]:
            shard = ray.train.get_dataset_shard("val")
            max_batches = self.train_spec["eval_batches"]
            results = evaluate(self.engine, shard, self.task, self.micro, self.world, max_batches=max_batches)
        else:
            results = {}
        self.last_eval = {**results, "train/loss": self.last_loss}
        if results:
            self.reporter.event("eval", step=self.position.step, **results)
            self.unsaved["evals"].append(self.reporter.events[-1])

    def _stream(self) -> Any:
        import ray.train

        plan = StreamPlan(
            micro=self.micro,
            per_step=self.global_batch // self.micro,
            rank=self.rank,
            world=self.world,
            epochs=self.train_spec["epochs"],
            shuffle_buffer=self.spec["data"]["shuffle_buffer"],
            seed=self.train_spec["seed"],
            skipped_steps=set(self.skipped_steps),
        )
        return micro_batches(ray.train.get_dataset_shard("train"), plan, self.position)

    def run(self) -> None:
        self.restore()
        self.reporter.send(self._summary())
        if self.failure["on_nan"] == "rollback" and self.position.step == 0:
            self.save()  # something to roll back to before the first checkpoint
        while self.position.step < self.total_steps:
            outcome = self._train_stream()
            if outcome == "rollback":
                self.checkpointer.finish_pending()
                self.restore(reason="rollback")
                if self.audit:
                    self.audit.new_lineage()
                self.reporter.send(self._summary())
            elif outcome in ("done", "fatal"):
                break
            else:  # the data ran out (epochs mode) before the planned step count
                self._evaluate()
                self.save(final=True)
                break
        else:
            self.reporter.send(self._summary(final=True))
        self.watchdog.disarm()

    def _train_stream(self) -> str:
        """Train from the current position until done, a NaN rollback, a fatal error or the data's end."""
        every_ckpt, every_eval = self.spec["checkpoint"]["every_steps"], self.train_spec["eval_every"]
        per_step = self.global_batch // self.micro
        self.watchdog.arm()
        started, self.data_wait = time.perf_counter(), 0.0
        for group in self._steps(self._timed(self._stream())):
            self.profile.before_step(self.position.step + 1)
            batches = [self.engine.combine(i.batch) for i in group]
            if self.flops_per_step is None:
                self.flops_per_step = self._flops_per_step(batches[0])
            timer = time.perf_counter()
            local_loss, weight = self.engine.forward_backward(batches, clock=self.clock)
            self.clock.add("forward_backward", time.perf_counter() - timer)
            phases = self.clock.take()
            per_rank = {
                "busy_s": self.data_wait + phases.get("forward", 0.0),
                "peak_mb": peak_memory_mb(self.device),
                **self.gpu.read(),
            }
            loss, report_due, written, gathered = self.reporter.stats.reduce(
                local_loss, weight, self.checkpointer.written_here(), per_rank
            )
            if written and self.checkpointer.pending is not None:
                self.checkpointer.finish_pending()
            last = group[-1]
            self.position.epoch = last.epoch
            self.position.batches_in_epoch = (last.index // per_step + 1) * per_step
            self.position.samples += self.global_batch
            if not math.isfinite(loss):
                outcome = self._non_finite(loss, last.epoch, last.index // per_step)
                if outcome != "skip":
                    return outcome
                started = time.perf_counter()
                continue
            timer = time.perf_counter()
            self.engine.optimizer_step()
            phases["optimizer"] = time.perf_counter() - timer
            self.position.step += 1
            self.last_loss = loss
            if self.audit:
                self.audit.record(self.position.step, last.epoch, group)
            elapsed, started = time.perf_counter() - started, time.perf_counter()
            self._record(loss, elapsed, self._predicted(last.batch), phases, gathered)
            step, done = self.position.step, self.position.step >= self.total_steps
            if trace := self.profile.after_step(step):
                self.reporter.profiles.append(trace)
            if done or (every_eval and step % every_eval == 0):
                with self._stall("eval"):
                    self._evaluate()
            self.watchdog.arm()
            if done or (every_ckpt and step % every_ckpt == 0):
                with self._stall("checkpoint"):
                    self.save(final=done)
            elif report_due or self.reporter.events or self.reporter.profiles:
                self.reporter.send(self._summary())
            self.watchdog.arm()
            if done:
                return "done"
        return "exhausted"

    def _steps(self, items: Any) -> Any:
        """Group this rank's micro-batches into optimizer steps (the stream yields whole steps)."""
        group: list = []
        for item in items:
            group.append(item)
            if len(group) == self.accum:
                yield group
                group = []

    def _non_finite(self, loss: float, epoch: int, step_in_epoch: int) -> str:
        """failure.on_nan: 'fail' stops the run, 'skip' drops this step's update, 'rollback'
        restores the last checkpoint and leaves this step's batch out from then on."""
        policy, step = self.failure["on_nan"], self.position.step + 1
        self.engine.discard_gradients()
        self.nan_steps += 1
        if policy == "fail" or self.nan_steps > self.failure["max_nan_steps"]:
            limit = self.failure["max_nan_steps"]
            why = "failure.on_nan: fail" if policy == "fail" else f"more than failure.max_nan_steps ({limit})"
            self._fail(f"training loss is {loss} at step {step} ({why})")
            return "fatal"
        self.skipped_steps.add((epoch, step_in_epoch))
        self.reporter.event(
            f"nan_{policy}", step=step, epoch=epoch, step_in_epoch=step_in_epoch, loss=str(loss)
        )
        return policy

    def _timed(self, stream: Any) -> Any:
        """The stream, adding the time spent waiting for each item to `self.data_wait`."""
        iterator = iter(stream)
        while True:
            waited = time.perf_counter()
            item = next(iterator, None)
            self.data_wait += time.perf_counter() - waited
            if item is None:
                return
            yield item

    def _predicted(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens predicted per sample: a window of T+1 tokens trains T next-token predictions."""
        return batch["tokens"].shape[1] - 1 if self.task == "lm" else 0

    @contextmanager
    def _stall(self, kind: str) -> Iterator[None]:
        """Time spent between steps (evaluating, checkpointing): part of the next step's time."""
        started = time.perf_counter()
        yield
        self.stalls[kind] += time.perf_counter() - started

    def _flops_per_step(self, batch: dict[str, torch.Tensor]) -> float:
        """Model FLOPs of one optimizer step (every rank's share), traced once on meta."""
        try:
            cost = trace_cost(self.spec["model"], self.task, batch_shapes(batch))
        except Exception as exc:  # a user model that cannot be built on meta: no FLOP metrics
            self.reporter.event("flops_unavailable", reason=f"{type(exc).__name__}: {exc}"[:300])
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
        samples = self.global_batch
        record = {
            "step": self.position.step,
            "time": time.time(),  # when the step ended: MLflow's timestamp for this step's points
            "train/loss": loss,
            "train/lr": self.engine.lr,
            "train/grad_norm": self.engine.last_grad_norm,
            "train/samples_per_s": samples / elapsed,
            "train/samples_per_s_per_worker": samples / elapsed / self.world,
            "train/data_wait_share": self.data_wait / elapsed,  # of this step's wall time
            "train/epoch": self.position.epoch,
            "time/step_s": elapsed,
            "time/data_wait_s": self.data_wait,
            "time/forward_backward_s": phases.get("forward_backward", 0.0),
            "time/forward_s": phases.get("forward", 0.0),
            "time/optimizer_s": phases.get("optimizer", 0.0),
            "time/checkpoint_s": self.stalls["checkpoint"],
            "time/eval_s": self.stalls["eval"],
            **worker_metrics(gathered, self.gpu.available),
        }
        self.stalls = {"checkpoint": 0.0, "eval": 0.0}
        if self.flops_per_step:
            record["perf/tflops"] = self.flops_per_step / elapsed / 1e12
            record["perf/tflops_per_worker"] = record["perf/tflops"] / self.world
        if self.task == "lm":
            record["train/tokens_per_s"] = samples * predicted_per_sample / elapsed
            record["train/tokens_per_s_per_worker"] = record["train/tokens_per_s"] / self.world
        # Every rank sees the same gathered times and so records the same events: a rank-0-only
        # event would make rank 0 alone decide to report, and ray.train.report is a barrier.
        for event in self.stragglers.observe(self.position.step, gathered["busy_s"]):
            self.reporter.event(event.pop("kind"), **event)
        if self.engine.precision.scaler is not None:
            record["train/skipped_steps"] = self.engine.precision.skipped_steps
        self.reporter.record_step(record)
        self.unsaved["steps"].append(record)
        self.data_wait = 0.0

    def _fail(self, reason: str) -> None:
        """A failure that a restart cannot fix: tell the driver, then stop cleanly."""
        self.watchdog.disarm()
        self.reporter.event("fatal", reason=reason, step=self.position.step)
        self.reporter.send(self._summary(fatal=reason))


def train(config: dict[str, Any]) -> None:
    """Entry point for `TorchTrainer(train_loop_per_worker=...)`."""
    for path in config.get("sys_path", []):
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(config["threads_per_worker"])
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    write_pid_file(config["run_dir"], rank, attempt_id=os.environ.get("SHOAL_ATTEMPT", uuid.uuid4().hex[:8]))
    Trainer(config).run()
