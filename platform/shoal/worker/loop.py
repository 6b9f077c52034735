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
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shoal.models import build_model, count_parameters
from shoal.worker import checkpoint
from shoal.worker.checkpoint import Position
from shoal.worker.optim import build_optimizer, build_scheduler
from shoal.worker.reporting import Reporter, StepStats
from shoal.worker.runtime import HangWatchdog, pick_device, seed_everything, write_pid_file
from shoal.worker.steps import batch_size_of, evaluate, forward_loss
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
    def __init__(self, config: dict[str, Any]):
        import ray.train

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.config, self.spec = config, config["workload"]
        self.train_spec, self.task = self.spec["train"], config["data"]["task"]
        self.micro = self.spec["data"]["batch_size"]
        self.accum = accumulation_steps(
            self.train_spec["global_batch_size"], self.micro, self.world
        )
        self.total_steps = planned_steps(
            self.train_spec, config.get("train_rows"), self.micro, self.world
        )
        self.device = pick_device(context.get_local_rank())
        seed_everything(self.train_spec["seed"])  # identical initial weights on every rank
        self.model = build_model(self.spec["model"]).to(self.device)
        self.parameters = count_parameters(self.model)
        self.ddp = self.world > 1 and dist.is_initialized()
        if self.ddp:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = build_optimizer(self.model, self.train_spec["optimizer"])
        self.scheduler = build_scheduler(
            self.optimizer, self.total_steps, self.train_spec["schedule"]
        )
        self.position = Position()
        self.saved_step = -1
        self.reporter = Reporter(StepStats(self.world, config["report_interval_s"], self.rank == 0))
        self.watchdog = HangWatchdog(
            self.spec["failure"]["hang_timeout_s"], config["run_dir"], self.rank
        )
        self.autocast_dtype = torch.bfloat16 if self.train_spec["precision"] == "bf16" else None

    # -- checkpoints -------------------------------------------------------------
    def restore(self) -> None:
        import ray.train

        found = ray.train.get_checkpoint()
        restored_from, old_world = None, self.world
        if found is not None:
            with found.as_directory() as directory:
                self.position, old_world = checkpoint.restore(
                    Path(directory), self.model, self.optimizer, self.scheduler, self.rank
                )
            restored_from = self.saved_step = self.position.step
            if old_world != self.world:  # same samples read, spread over a new number of ranks
                self.position.batches_in_epoch = (
                    self.position.batches_in_epoch * old_world // self.world
                )
        seed_everything(self.train_spec["seed"] * 7919 + self.rank + 1000 * self.position.step)
        self.reporter.event(
            "attempt_started",
            world_size=self.world,
            restored_step=restored_from,
            previous_world_size=old_world if restored_from is not None else None,
            parameters=self.parameters,
            accumulation=self.accum,
            total_steps=self.total_steps,
            device=str(self.device),
        )
        self.reporter.send(self._summary())

    def save(self, final: bool = False) -> None:
        if self.position.step == self.saved_step:  # nothing new since the last checkpoint
            self.reporter.send(self._summary(final=final))
            return
        self.saved_step = self.position.step
        with tempfile.TemporaryDirectory(prefix="shoal-ckpt-") as tmp:
            checkpoint.save(
                Path(tmp),
                self.model,
                self.optimizer,
                self.scheduler,
                self.position,
                self.rank,
                self.world,
            )
            import ray.train

            self.reporter.send(
                self._summary(checkpointed=True, final=final),
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=f"checkpoint-{self.position.step:08d}",
            )

    # -- steps -------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self, group: list[tuple[int, int, dict[str, torch.Tensor]]]) -> float:
        self.model.train()
        loss_sum = 0.0
        for index, (_, _, batch) in enumerate(group):
            last = index == len(group) - 1
            sync = nullcontext() if (last or not self.ddp) else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss, _ = forward_loss(self.model, batch, self.task, self.device)
                (loss / len(group)).backward()
            loss_sum += loss.item()
        clip = self.train_spec["clip_grad_norm"]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._last_grad_norm = float(grad_norm)
        return loss_sum / len(group)

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

        val = ray.train.get_dataset_shard("val") if self.config["data"]["val"] else None
        if val is None:
            return
        with self._autocast():
            results = evaluate(
                self.model,
                val,
                self.task,
                self.micro,
                self.device,
                self.world,
                max_batches=self.train_spec["eval_batches"],
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
        every_ckpt, every_eval = (
            self.spec["checkpoint"]["every_steps"],
            self.train_spec["eval_every"],
        )
        self.watchdog.arm()
        started = time.perf_counter()
        group: list = []
        for item in stream:
            group.append(item)
            if len(group) < self.accum:
                continue
            local_loss = self.train_step(group)
            epoch, index, _ = group[-1]
            samples = sum(batch_size_of(b) for _, _, b in group) * self.world
            self.position = Position(
                self.position.step + 1, epoch, index, self.position.samples + samples
            )
            group = []
            loss, report_due = self.reporter.stats.reduce(local_loss)
            if not math.isfinite(loss):
                self._fail(
                    f"training loss is {loss} at step {self.position.step} (failure.on_nan: fail)"
                )
                return
            elapsed, started = time.perf_counter() - started, time.perf_counter()
            self._record(loss, samples, elapsed)
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

    def _record(self, loss: float, samples: int, elapsed: float) -> None:
        record = {
            "step": self.position.step,
            "train/loss": loss,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": self._last_grad_norm,
            "train/samples_per_s": samples / elapsed,
            "train/epoch": self.position.epoch,
        }
        if self.task == "lm":
            record["train/tokens_per_s"] = samples * self.model_seq_len() / elapsed
        self.reporter.record_step(record)

    def model_seq_len(self) -> int:
        return int(self.spec["model"]["args"].get("seq_len", 128))

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
    write_pid_file(
        config["run_dir"], rank, attempt_id=os.environ.get("SHOAL_ATTEMPT", uuid.uuid4().hex[:8])
    )
    Trainer(config).run()
