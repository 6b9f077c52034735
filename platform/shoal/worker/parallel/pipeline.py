"""Pipeline parallelism for the GPT: stages by layers, and the schedules that run them.

Stage s of S holds a contiguous run of blocks under their original names, so a
checkpoint written with pipelining loads without it and the other way round.
The first stage also holds the embeddings, the last the final norm and head.
With `interleaved_1f1b`, each rank holds two stages: s and s + pp.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved_1f1b" else 1


def layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible runs of layers; earlier stages get the extra ones."""
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_module(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of the model keeping only what stage `stage` computes."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ranges(len(model.blocks), num_stages)[stage]}
    for name in list(part.blocks.keys()):
        if name not in keep:
            del part.blocks[name]
    if stage > 0:
        part.token_embedding = None
        part.position_embedding = None
    if stage < num_stages - 1:
        part.final_norm = None
        part.lm_head = None
    return part


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def build_schedule(
    stages: list[Any], schedule: str, microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> Any:
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
        from torch.distributed.pipelining import PipelineStage

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
