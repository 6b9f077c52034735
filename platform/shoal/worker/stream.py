"""Micro-batches in one global order, so that data survives failures and resizes.

Every rank reads the same stream of micro-batches (the training set is not split
by Ray: each epoch is one deterministic order, shuffled with a seed that depends
on the epoch only). Global micro-batch `i` of an epoch belongs to optimizer step
`i // per_step` and is trained by rank `i % world`. Because the order and the
micro-batch size do not depend on the world size, a position saved as "micro-
batches consumed in this epoch" means the same samples at any world size: a
resumed or resized run continues exactly where the checkpoint left off, and no
sample is trained twice or skipped.

A step's micro-batches are handed out only once the whole step is in the stream,
so a short tail at the end of an epoch (fewer rows than a global batch) is
dropped by every rank alike, instead of leaving one rank waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.worker.checkpoint.state import Position


@dataclass(frozen=True)
class Item:
    epoch: int
    index: int  # global micro-batch index within the epoch, from 0
    batch: dict[str, torch.Tensor]


@dataclass
class StreamPlan:
    micro: int  # rows per micro-batch (data.batch_size)
    per_step: int  # micro-batches per optimizer step, all ranks together
    rank: int
    world: int
    epochs: int | None
    shuffle_buffer: int
    seed: int
    skipped_steps: set[tuple[int, int]] = field(default_factory=set)  # (epoch, step in epoch) never trained


def micro_batches(shard: Any, plan: StreamPlan, position: Position) -> Iterator[Item]:
    """This rank's micro-batches from `position` on, step by step, for `plan.epochs` (or forever)."""
    epoch, consumed = position.epoch, position.batches_in_epoch
    while plan.epochs is None or epoch < plan.epochs:
        batches = shard.iter_torch_batches(
            batch_size=plan.micro,
            drop_last=True,
            local_shuffle_buffer_size=plan.shuffle_buffer or None,
            local_shuffle_seed=(plan.seed * 100_003 + epoch) if plan.shuffle_buffer else None,
        )
        mine: list[tuple[int, dict[str, torch.Tensor]]] = []
        for index, batch in enumerate(batches):
            if index < consumed:
                continue
            if index % plan.world == plan.rank:
                mine.append((index, batch))
            if index % plan.per_step == plan.per_step - 1:  # the whole step is in the stream
                if (epoch, index // plan.per_step) not in plan.skipped_steps:
                    yield from (Item(epoch, i, b) for i, b in mine)
                mine = []
        epoch, consumed = epoch + 1, 0
