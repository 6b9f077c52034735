"""A rank's lanes of one epoch's plan, read a window at a time.

The plan (data/epoch_plan.py) cuts each epoch into `per_step` lanes; data-parallel slot
`s` of `dp` trains lanes `s, s + dp, ...`. A lane is read one window at a time: the
window's row groups (data/reader.py), sliced to the window's rows, mixed by the plan.
While a rank trains on one window of a lane, a background thread reads the lane's next
one: pyarrow releases the GIL while it reads and decodes, so reading overlaps the step.

A row group that two consecutive windows of a lane share is read once; one that two
lanes share (where one lane ends and the next begins) is read by both lanes' ranks:
that, at most one row group at each end of a lane, is a rank's whole overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import pyarrow as pa
import torch

from shoal.data.epoch_plan import EpochPlan, Window
from shoal.data.reader import RowGroupReader, Rows


def lanes_of(slot: int, dp: int, per_step: int) -> range:
    """The lanes data-parallel slot `slot` of `dp` trains (dp divides per_step)."""
    if dp <= 0 or per_step % dp or not 0 <= slot < dp:
        raise ValueError(f"slot {slot} of {dp} cannot share {per_step} micro-batches per step")
    return range(slot, per_step, dp)


def slot_micro_batches(
    plan: EpochPlan,
    slot: int,
    dp: int,
    steps: Iterable[int],
    reader: RowGroupReader,
    loader: ThreadPoolExecutor,
) -> Iterator[MicroBatch]:
    """Slot `slot`'s micro-batches of optimizer steps `steps` (ascending) of the epoch, step by
    step, rows in training order. A first step late in the epoch opens the windows that hold
    it; nothing before them is read."""
    lanes, windows = lanes_of(slot, dp, plan.per_step), LaneWindows(plan, reader, loader)
    for j in steps:
        for lane in lanes:
            batch, rows = windows.micro_batch(lane, j)
            yield MicroBatch(lane + plan.per_step * j, batch, rows)


class MicroBatch(NamedTuple):
    index: int  # global micro-batch index within the epoch
    tensors: dict[str, torch.Tensor]  # its numeric columns (data/reader.py's Rows)
    rows: int


class LaneWindows:
    """One epoch's windows of a rank's lanes: the current window of each lane, and the next
    one being read on `loader` (one thread: reads happen one at a time, in request order)."""

    def __init__(self, plan: EpochPlan, reader: RowGroupReader, loader: ThreadPoolExecutor):
        self.plan, self.reader, self.loader = plan, reader, loader
        self.windows: dict[tuple[int, int], Future[Rows]] = {}  # (lane, window) -> mixed rows
        self.last_group: dict[int, tuple[int, pa.Table]] = {}  # per lane: the group read last

    def micro_batch(self, lane: int, j: int) -> tuple[dict[str, torch.Tensor], int]:
        """Lane `lane`'s `j`-th micro-batch, in training order: its tensors and row count."""
        k = self.plan.window_of(lane, j)
        rows = self._window(lane, k).result()
        if k + 1 < self.plan.windows_in_lane():
            self._window(lane, k + 1)  # read ahead
        for stale in [key for key in self.windows if key[0] == lane and key[1] < k]:
            del self.windows[stale]
        start = j * self.plan.micro - k * self.plan.window
        length = max(0, min(self.plan.micro, rows.count - start))
        return rows.take(start, length), length

    def _window(self, lane: int, k: int) -> Future[Rows]:
        if (lane, k) not in self.windows:
            self.windows[(lane, k)] = self.loader.submit(self._read, self.plan.lane_window(lane, k))
        return self.windows[(lane, k)]

    def _read(self, window: Window) -> Rows:
        """A window's rows, mixed, as tensors (on the loader thread)."""
        parts = [self._group(window.lane, p.group).slice(p.start, p.stop - p.start) for p in window.pieces]
        rows = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        return Rows.of(rows.take(pa.array(window.mix, type=pa.int64())))

    def _group(self, lane: int, group: int) -> pa.Table:
        cached = self.last_group.get(lane)
        if cached is None or cached[0] != group:
            cached = (group, self.reader.read(group))
            self.last_group[lane] = cached
        return cached[1]
