"""The training loop each Ray Train worker runs: `train(config)`.

Everything arrives in `config` (plain data from the driver): the resolved
workload, the data plan, the run directory. The trainer is a handful of named
parts (model, optimizer, scheduler, batches, reporter, watchdog) and one loop.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from shoal.worker import checkpoint
from shoal.worker.checkpoint import Position
from shoal.worker.engine import Engine
from shoal.worker.reporting import Reporter, StepStats
from shoal.worker.runtime import HangWatchdog, pick_device, seed_everything, write_pid_file
from shoal.worker.steps import batch_size_of, evaluate
from shoal.worker.stream import micro_batches


def accumulation_steps(global_batch: int | None, micro: int, world: int) -> int:
    if global_batch is None:
        return 1
    if global_batch % (micro * world):
        raise ValueError(
            f"train.global_batch_size {global_batch} is not a multiple of "
            f"data.batch_size {micro} x {world} workers"
        )
    return global_batch // (micro * world)


def planned_steps(train: dict[str, Any], train_rows: int | None, micro: int, world: int) -> int:
    """Optimizer steps the run will take: max_steps, or what `epochs` of data give."""
    if train["max_steps"] is not None:
        return train["max_steps"]
    if not train_rows:
        raise ValueError("train.epochs needs the training set's row count; use train.max_steps")
    accum = accumulation_steps(train["global_batch_size"], micro, world)
    per_rank_batches = (train_rows // world) // micro
    return max(1, math.floor(train["epochs"] * per_rank_batches / accum))


class Trainer:
    """A Ray Train worker's loop around the Engine: data, checkpoints, reports, watchdog."""

    def __init__(self, config: dict[str, Any]):
        import ray.train

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.config, self.spec = config, config["workload"]
        self.train_spec, self.task = self.spec["train"], config["data"]["task"]
        self.micro = self.spec["data"]["batch_size"]
        self.accum = accumulation_steps(self.train_spec["global_batch_size"], self.micro, self.world)
        self.total_steps = planned_steps(self.train_spec, config.get("train_rows"), self.micro, self.world)
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
        self.reporter = Reporter(StepStats(self.world, config["report_interval_s"], self.rank == 0))
        self.watchdog = HangWatchdog(self.spec["failure"]["hang_timeout_s"], config["run_dir"], self.rank)

    # -- checkpoints -------------------------------------------------------------
    def restore(self) -> None:
        import ray.train

        engine, found = self.engine, ray.train.get_checkpoint()
        restored_from, old_world = None, self.world
        if found is not None:
            with found.as_directory() as directory:
                self.position, old_world = checkpoint.restore(
                    Path(directory), engine.parts, engine.optimizers, engine.schedulers, self.rank
                )
            restored_from = self.saved_step = self.position.step
            if old_world != self.world:  # same samples read, spread over a new number of ranks
                self.position.batches_in_epoch = self.position.batches_in_epoch * old_world // self.world
        seed_everything(self.train_spec["seed"] * 7919 + self.rank + 1000 * self.position.step)
        self.reporter.event(
            "attempt_started",
            world_size=self.world,
            restored_step=restored_from,
            previous_world_size=old_world if restored_from is not None else None,
            parameters=engine.parameters,
            accumulation=self.accum,
            total_steps=self.total_steps,
            device=str(self.device),
            parallel=engine.describe(),
        )
        self.reporter.send(self._summary())

    def save(self, final: bool = False) -> None:
        import ray.train

        if self.position.step == self.saved_step:  # nothing new since the last checkpoint
            self.reporter.send(self._summary(final=final))
            return
        self.saved_step = self.position.step
        engine = self.engine
        with tempfile.TemporaryDirectory(prefix="shoal-ckpt-") as tmp:
            checkpoint.save(
                Path(tmp),
                engine.parts,
                engine.optimizers,
                engine.schedulers[0],
                self.position,
                self.rank,
                self.world,
            )
            self.reporter.send(
                self._summary(checkpointed=True, final=final),
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=f"checkpoint-{self.position.step:08d}",
            )

    # -- steps -------------------------------------------------------------------
    def _summary(self, **extra: Any) -> dict[str, Any]:
        return {
            "step": self.position.step,
            "epoch": self.position.epoch,
            "samples": self.position.samples,
            "world_size": self.world,
            "total_steps": self.total_steps,
            **extra,
        }

    def _evaluate(self) -> None:
        import ray.train

        if not self.config["data"]["val"]:
            return
        shard = ray.train.get_dataset_shard("val")
        results = evaluate(
            self.engine, shard, self.task, self.micro, self.world, max_batches=self.train_spec["eval_batches"]
        )
        self.reporter.event("eval", step=self.position.step, **results)

    def run(self) -> None:
        import ray.train

        self.restore()
        if self.position.step >= self.total_steps:
            self.reporter.send(self._summary(final=True))
            return
        stream = micro_batches(
            ray.train.get_dataset_shard("train"),
            micro=self.micro,
            position=self.position,
            epochs=self.train_spec["epochs"],
            shuffle_buffer=self.spec["data"]["shuffle_buffer"],
            seed=self.train_spec["seed"],
        )
        every_ckpt, every_eval = self.spec["checkpoint"]["every_steps"], self.train_spec["eval_every"]
        self.watchdog.arm()
        started = time.perf_counter()
        group: list = []
        self.data_wait = 0.0
        for item in self._timed(stream):
            group.append(item)
            if len(group) < self.accum:
                continue
            local_loss, weight = self.engine.train_step([self.engine.combine(b) for _, _, b in group])
            epoch, index, last = group[-1]
            samples = sum(batch_size_of(b) for _, _, b in group) * self.world
            self.position = Position(self.position.step + 1, epoch, index, self.position.samples + samples)
            group = []
            loss, report_due = self.reporter.stats.reduce(local_loss, weight)
            if not math.isfinite(loss):
                self._fail(f"training loss is {loss} at step {self.position.step} (failure.on_nan: fail)")
                return
            elapsed, started = time.perf_counter() - started, time.perf_counter()
            self._record(loss, samples, elapsed, predicted_per_sample=self._predicted(last))
            step, done = self.position.step, self.position.step >= self.total_steps
            if done or (every_eval and step % every_eval == 0):
                self._evaluate()
            self.watchdog.arm()
            if done or (every_ckpt and step % every_ckpt == 0):
                self.save(final=done)
            elif report_due or self.reporter.events:
                self.reporter.send(self._summary())
            self.watchdog.arm()
            if done:
                break
        else:  # the data ran out (epochs mode) before the planned step count
            self._evaluate()
            self.save(final=True)
        self.watchdog.disarm()

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

    def _record(self, loss: float, samples: int, elapsed: float, predicted_per_sample: int) -> None:
        record = {
            "step": self.position.step,
            "time": time.time(),  # when the step ended: MLflow's timestamp for this step's points
            "train/loss": loss,
            "train/lr": self.engine.lr,
            "train/grad_norm": self.engine.last_grad_norm,
            "train/samples_per_s": samples / elapsed,
            "train/data_wait_share": self.data_wait / elapsed,  # of this step's wall time
            "train/epoch": self.position.epoch,
        }
        if self.task == "lm":
            record["train/tokens_per_s"] = samples * predicted_per_sample / elapsed
        if self.engine.precision.scaler is not None:
            record["train/skipped_steps"] = self.engine.precision.skipped_steps
        self.reporter.record_step(record)
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
