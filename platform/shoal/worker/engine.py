"""The training engine: parallel model parts, optimizers, precision and one step.

It knows nothing of Ray: the Ray Train loop (`loop.py`) feeds it batches, and
the equivalence tests drive the same code under torch.multiprocessing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shoal.data.sources import window_length
from shoal.degrees import stages_per_rank
from shoal.models import build_model, count_parameters
from shoal.models.objective import Objective
from shoal.models.registry import model_config
from shoal.spec.schema import OptimizerSpec, Workload
from shoal.worker.optim import build_optimizer, build_scheduler
from shoal.worker.parallel.dims import ParallelDims
from shoal.worker.parallel.parallelize import parallelize
from shoal.worker.parallel.pipeline import Pipeline, stage_indices, stage_module
from shoal.worker.parallel.stats_ride import StatsRide, ride_hook
from shoal.worker.precision import Precision
from shoal.worker.runtime import seed_everything
from shoal.worker.steps import BatchTotals


class StepLoss(NamedTuple):
    loss: float  # this rank's mean over the step's micro-batches
    weight: float  # 0 on pipeline stages that have no loss
    metrics: dict[str, float]  # the model's own metrics, averaged over the micro-batches


class Engine:
    def __init__(
        self,
        workload: Workload,
        task: str,
        world: int,
        device: torch.device,
        total_steps: int,
        accumulation: int,
        compile_cache: str | None = None,
    ):
        self.workload, self.task, self.device, self.accumulation = workload, task, device, accumulation
        train = workload.train
        self.dims = ParallelDims.from_spec(workload.parallel.model_dump(), world)
        self.mesh = self.dims.build_mesh(device.type) if world > 1 else None
        self.precision = Precision(train.precision, device, self.dims.uses_fsdp)
        seed_everything(train.seed)  # identical initial weights on every rank
        model = build_model(self.model_config(workload))
        self.objective = Objective.build(task, model, workload.data.columns, workload.model.loss)
        self.parameters = count_parameters(model)
        self.precision.prepare(model)
        parts, indices = self._split(model)
        self.parts = [
            parallelize(
                part.to(device),
                self.dims,
                self.mesh,
                device,
                activation_checkpointing=train.activation_checkpointing,
                compile_model=train.compile,
                compile_cache=compile_cache,
                fsdp_param_dtype=self.precision.fsdp_param_dtype,
            )
            for part in parts
        ]
        self.pipeline = self._pipeline(indices) if self.dims.pp > 1 else None
        self.params_by_mesh = params_by_mesh(self.parts)
        self.stats_ride = self._stats_ride(world)
        self.optimizers = [build_optimizer(part, train.optimizer) for part in self.parts]
        self.schedulers = [build_scheduler(o, total_steps, train.schedule) for o in self.optimizers]
        self.mp_group, self.mp_ranks = (None, [dist.get_rank()] if world > 1 else [0])
        if self.dims.model_parallel > 1:
            self.mp_group, self.mp_ranks = self.dims.model_parallel_groups(self.mesh)
        self.last_grad_norm = 0.0

    # -- construction -------------------------------------------------------------
    @staticmethod
    def model_config(workload: Workload) -> dict[str, Any]:
        """The model section, its `seq_len` filled from the data's window length if it takes one."""
        model = workload.model.model_dump()
        return model_config(model, window_length(workload.data.seq_len, model["args"]))

    def _split(self, model: nn.Module) -> tuple[list[nn.Module], list[int]]:
        if self.dims.pp == 1:
            return [model], [0]
        schedule = self.workload.parallel.pp_schedule
        pp_rank = self.mesh["pp"].get_local_rank()
        indices = stage_indices(pp_rank, self.dims.pp, schedule)
        num_stages = self.dims.pp * stages_per_rank(schedule)
        return [stage_module(model, i, num_stages) for i in indices], indices

    def _stats_ride(self, world: int) -> StatsRide | None:
        """On CPU, plain DDP's first gradient all-reduce carries the step's stats (the
        loop's StepStats): one collective a step instead of two. GPUs read the loss only
        after the backward pass, too late to ride it."""
        part = self.parts[0]
        if self.device.type != "cpu" or world == 1 or not isinstance(part, DistributedDataParallel):
            return None
        if self.dims.tp > 1 or self.dims.pp > 1:  # the stats' group would not be DDP's
            return None
        ride = StatsRide(world)
        part.register_comm_hook(ride, ride_hook)
        return ride

    def _pipeline(self, indices: list[int]) -> Pipeline:
        parallel = self.workload.parallel
        schedule = parallel.pp_schedule
        num_stages = self.dims.pp * stages_per_rank(schedule)

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            return loss / self.accumulation

        microbatches = parallel.microbatches or num_stages
        return Pipeline(
            self.parts,
            indices,
            num_stages,
            self.device,
            self.mesh["pp"].get_group(),
            schedule,
            microbatches,
            loss_fn,
        )

    # -- data -----------------------------------------------------------------------
    def data_slot(self) -> tuple[int, int]:
        """(this rank's data-parallel slot, how many there are): ranks of a slot (tp x pp)
        train one model replica's share."""
        if self.mesh is None:
            return 0, 1
        replicate = self.mesh["dp_replicate"].get_local_rank()
        shard = self.mesh["dp_shard"].get_local_rank()
        return replicate * self.dims.dp_shard + shard, self.dims.dp

    def combine(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Ranks that share a data-parallel slot (tp x pp) train on the union of their reads."""
        if self.mp_group is None:
            return batch
        combined = {}
        for key, tensor in batch.items():
            pieces = [torch.empty_like(tensor) for _ in self.mp_ranks]
            dist.all_gather(pieces, tensor.contiguous(), group=self.mp_group)
            combined[key] = torch.cat(pieces)
        return combined

    # -- steps ----------------------------------------------------------------------
    def _sync_context(self, last: bool) -> Any:
        part = self.parts[0]
        if self.dims.uses_fsdp:
            part.set_requires_gradient_sync(last)
        elif self.dims.uses_ddp and not last:
            return part.no_sync()
        return nullcontext()

    def train_step(self, group: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """Forward/backward over the micro-batches of one optimizer step, then the step."""
        loss, weight, _ = self.forward_backward(group)
        self.optimizer_step()
        return loss, weight

    def forward_backward(
        self,
        group: list[dict[str, torch.Tensor]],
        clock: Any = None,
        after_forward: Callable[[StepLoss], None] | None = None,
    ) -> StepLoss:
        """Gradients of one optimizer step's micro-batches, not yet applied; `clock` (a
        PhaseClock) times the forward passes (pipelines: the whole schedule). `after_forward`
        gets the step's loss between the last forward and the last backward pass (not with
        pipelines: their schedule runs both)."""
        span = clock.span if clock is not None else (lambda name: nullcontext())
        for part in self.parts:
            if not part.training:  # train() walks every module: ~40 us a step on a small GPT
                part.train()
        if self.pipeline is not None:
            losses = []
            for batch in group:
                tokens = self._tokens(batch)
                with span("forward"):
                    outputs = self.pipeline.step(tokens[:, :-1], tokens[:, 1:])
                losses += [x.item() * self.accumulation for x in outputs]
            return StepLoss(sum(losses) / len(losses), 1.0, {}) if losses else StepLoss(0.0, 0.0, {})
        total = torch.zeros((), device=self.device)
        metrics: dict[str, torch.Tensor] = {}
        step_loss = None
        for index, batch in enumerate(group):
            last = index == len(group) - 1
            with self._sync_context(last):
                with span("forward"), self.precision.autocast():
                    result = self.objective.step(self.parts[0], batch, self.device)
                total += result.loss.detach()
                for name, value in result.metrics.items():
                    metrics[name] = metrics.get(name, 0.0) + value.detach().float()
                if last and after_forward is not None:
                    step_loss = self._step_loss(total, metrics, len(group))
                    after_forward(step_loss)
                self.precision.backward(result.loss / len(group))
        return step_loss or self._step_loss(total, metrics, len(group))

    @staticmethod
    def _step_loss(total: torch.Tensor, metrics: dict[str, torch.Tensor], count: int) -> StepLoss:
        names = list(metrics)
        # One device sync per step: the loss and every metric come back together.
        values = torch.stack([total, *(metrics[n].to(total.device) for n in names)]).tolist()
        step_metrics = {n: v / count for n, v in zip(names, values[1:], strict=True)}
        return StepLoss(values[0] / count, 1.0, step_metrics)

    def _tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch[self.objective.token_column() or "tokens"].to(self.device).long()

    def discard_gradients(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        self.precision.unscale(self.optimizers)
        clip = self.workload.train.clip_grad_norm
        self.last_grad_norm = clip_grad_norm(self.params_by_mesh, clip, self.mesh, self.dims)
        self.precision.step(self.optimizers)
        for scheduler in self.schedulers:
            scheduler.step()
        self.discard_gradients()

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, torch.Tensor]) -> BatchTotals:
        """This rank's sums over one batch; zeros on loss-less pipeline stages."""
        for part in self.parts:
            part.eval()
        samples = len(next(iter(batch.values())))
        if self.pipeline is not None:
            tokens = self._tokens(batch)
            losses = self.pipeline.evaluate(tokens[:, :-1], tokens[:, 1:])
            if not losses:
                return BatchTotals(0.0, 0.0, 0.0, {})
            mean = sum(x.item() for x in losses) * self.accumulation / len(losses)
            return BatchTotals(mean * samples, 0.0, samples, {})
        with self.precision.autocast():
            result = self.objective.step(self.parts[0], batch, self.device)
        metrics = {name: value.float().item() * samples for name, value in result.metrics.items()}
        return BatchTotals(result.loss.item() * samples, float(result.correct), samples, metrics)

    def apply_optimizer_settings(self, optimizer: OptimizerSpec) -> None:
        """Replace restored hyperparameters with the spec's (a checkpoint from a run with other
        settings, as in population-based training); the schedule keeps its step."""
        for opt, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            scheduler.base_lrs = [optimizer.lr] * len(opt.param_groups)
            for group, factor in zip(opt.param_groups, scheduler.lr_lambdas, strict=True):
                group["initial_lr"] = optimizer.lr
                group["lr"] = optimizer.lr * factor(scheduler.last_epoch)
                group["weight_decay"] = optimizer.weight_decay
                if "momentum" in group:
                    group["momentum"] = optimizer.momentum
                if "betas" in group:
                    group["betas"] = optimizer.betas

    @property
    def lr(self) -> float:
        return self.optimizers[0].param_groups[0]["lr"]  # the schedule's current value

    def describe(self) -> dict[str, Any]:
        d = self.dims
        return {
            "pp": d.pp,
            "dp_replicate": d.dp_replicate,
            "dp_shard": d.dp_shard,
            "tp": d.tp,
            "precision": self.precision.name,  # `auto` resolved, the same on every rank
            "precision_asked": self.precision.asked,
            "hardware": self.precision.hardware,  # this rank's device, as shoal/hardware.py says it
        }


def params_by_mesh(parts: list[nn.Module]) -> dict[Any, list[nn.Parameter]]:
    """The parts' parameters by device mesh (None: plain tensors), listed once: listing them
    walks every module, a fifth of a millisecond a step on a small model."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for part in parts:
        for param in part.parameters():
            groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return groups


def clip_grad_norm(
    params: dict[Any, list[nn.Parameter]], max_norm: float | None, mesh: Any, dims: ParallelDims
) -> float:
    """Global gradient norm over every rank's shard (and every pipeline stage) of the
    parameters grouped by mesh (`params_by_mesh`); clips if asked."""
    by_mesh = {m: [p.grad for p in group if p.grad is not None] for m, group in params.items()}
    squared = torch.zeros((), dtype=torch.float64)
    for group_mesh, grads in by_mesh.items():
        if not grads:
            continue
        norm = torch.nn.utils.get_total_norm(grads)
        if group_mesh is not None:
            norm = norm.full_tensor()
        squared += norm.double().cpu() ** 2
    if dims.pp > 1:
        dist.all_reduce(squared, group=mesh["pp"].get_group())
    total = math.sqrt(squared.item())
    if max_norm is not None and total > max_norm:
        coefficient = max_norm / (total + 1e-6)
        for grads in by_mesh.values():
            if grads:
                torch._foreach_mul_(grads, coefficient)  # one call per mesh, as torch's own clipping
    return total
