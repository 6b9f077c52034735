"""This rank's micro-batches, read from its own lanes of each epoch's plan.

The plan (data/epoch_plan.py) fixes which rows make up global micro-batch `i` of an
epoch, whatever the world size: it belongs to optimizer step `i // per_step` and is
trained by rank `i % world`. So a position saved as "micro-batches consumed in this
epoch" means the same rows at any world size, and a resumed or resized rank opens the
window of row groups that holds its position instead of replaying the epoch.

A rank reads only its lanes' row groups, a window ahead on a background thread
(data/lanes.py, data/reader.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from shoal.data.epoch_plan import EpochPlan, plan_for
from shoal.data.errors import DataError
from shoal.data.lanes import slot_micro_batches
from shoal.data.manifest import Manifest
from shoal.data.reader import ReadCounts, RowGroupReader
from shoal.worker.checkpoint.state import Position

T = TypeVar("T")


@dataclass(frozen=True)
class Item:
    epoch: int
    index: int  # global micro-batch index within the epoch, from 0
    batch: dict[str, torch.Tensor]
    last_of_epoch: bool = False  # in the epoch's last optimizer step


@dataclass
class StreamPlan:
    micro: int  # rows per micro-batch (data.batch_size)
    per_step: int  # micro-batches per optimizer step, all ranks together
    rank: int
    world: int
    epochs: int | None
    shuffle_buffer: int  # rows each lane mixes at a time; 0: no shuffle
    seed: int
    skipped_steps: set[tuple[int, int]] = field(default_factory=set)  # (epoch, step in epoch) never trained

    def epoch(self, manifest: Manifest, epoch: int) -> EpochPlan:
        return plan_for(
            manifest, self.seed, epoch, self.micro, self.micro * self.per_step, self.shuffle_buffer
        )


def micro_batches(
    manifest: Manifest,
    plan: StreamPlan,
    position: Position,
    counts: ReadCounts,
    reader: RowGroupReader | None = None,
) -> Iterator[Item]:
    """This rank's micro-batches from `position` on, step by step, for `plan.epochs` (or
    forever). `counts` adds up what this rank reads, decodes and trains in the current epoch
    (zeroed as each epoch starts): read it in the epoch's last step (`Item.last_of_epoch`)."""
    reader = reader or RowGroupReader(manifest, counts)
    epoch, consumed = position.epoch, position.batches_in_epoch
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-read") as loader:
        while plan.epochs is None or epoch < plan.epochs:
            epoch_plan = plan.epoch(manifest, epoch)
            if epoch_plan.steps == 0:
                raise DataError(
                    manifest.root or "data",
                    f"{manifest.total_rows} training rows are fewer than one global batch "
                    f"({epoch_plan.global_batch})",
                )
            counts.take()
            steps = [
                j
                for j in range(consumed // plan.per_step, epoch_plan.steps)
                if (epoch, j) not in plan.skipped_steps
            ]
            read = slot_micro_batches(epoch_plan, plan.rank, plan.world, steps, reader, loader)
            for index, batch, rows in read:
                counts.rows_trained += rows
                yield Item(epoch, index, batch, index // plan.per_step == epoch_plan.steps - 1)
            epoch, consumed = epoch + 1, 0


def timed(items: Iterable[T], waited: Callable[[float], None]) -> Iterator[T]:
    """The items, telling `waited` how many seconds each took to arrive."""
    iterator = iter(items)
    while True:
        started = time.perf_counter()
        item = next(iterator, None)
        waited(time.perf_counter() - started)
        if item is None:
            return
        yield item


def optimizer_steps(items: Iterable[T], per_step: int) -> Iterator[list[T]]:
    """The micro-batches grouped into optimizer steps of `per_step` (the stream yields whole
    steps, so no group is left short)."""
    group: list[T] = []
    for item in items:
        group.append(item)
        if len(group) == per_step:
            yield group
            group = []
