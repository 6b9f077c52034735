"""Optimizer and learning-rate schedule from the `train` section."""

from __future__ import annotations

import math

import torch
from torch import nn

from shoal.spec.schema import OptimizerSpec, ScheduleSpec


def build_optimizer(model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    # Weight decay applies to matrices only, not to biases, norms or embeddings' 1-D params.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas)
    return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum)


def lr_multiplier(step: int, total_steps: int, schedule: ScheduleSpec) -> float:
    """Linear warmup, then cosine/linear decay to `min_lr_ratio` (or constant)."""
    warmup = schedule.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule.decay == "constant" or total_steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = schedule.min_lr_ratio
    if schedule.decay == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, schedule: ScheduleSpec
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, schedule)
    )
