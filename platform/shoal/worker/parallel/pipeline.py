"""Pipeline parallelism: a model's stages, and the schedules that run them.

The model cuts itself into stages (models/protocol.py's ParallelModel), each
keeping its parameters under their original names, so a checkpoint written with
pipelining loads without it and the other way round. With `interleaved_1f1b`,
each rank holds two stages: s and s + pp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.degrees import stages_per_rank
from shoal.models.protocol import ParallelModel


def stage_module(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of the model keeping only what stage `stage` computes."""
    if not isinstance(model, ParallelModel):
        raise TypeError(f"{type(model).__name__} cannot be cut into pipeline stages (models/protocol.py)")
    return model.pipeline_stage(stage, num_stages)


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def build_schedule(
    stages: list[Any], schedule: str, microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> Any:
    # Lazy (here and in Pipeline): torch.distributed.pipelining takes most of a second to
    # import, and only pp > 1 needs it.
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], microbatches, loss_fn=loss_fn)


class Pipeline:
    """This rank's stages and the schedule; one call runs one batch through every stage."""

    def __init__(
        self,
        parts: list[nn.Module],
        indices: list[int],
        num_stages: int,
        device: torch.device,
        group: Any,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
    ):
        from torch.distributed.pipelining import PipelineStage  # lazy: see build_schedule

        self.parts = parts
        self.has_first = 0 in indices
        self.has_last = num_stages - 1 in indices
        stages = [
            PipelineStage(part, index, num_stages, device, group=group)
            for part, index in zip(parts, indices, strict=True)
        ]
        self.schedule = build_schedule(stages, schedule, microbatches, loss_fn)

    def _run(
        self, call: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor
    ) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        extra = {"target": targets, "losses": losses} if self.has_last else {}
        call(*args, **extra)
        return losses

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of one batch; the per-microbatch losses on the last stage."""
        return self._run(self.schedule.step, inputs, targets)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return self._run(self.schedule.eval, inputs, targets)
