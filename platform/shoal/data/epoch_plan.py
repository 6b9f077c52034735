"""Which rows make up each global micro-batch of an epoch: a pure function of the data's
manifest, the seed, the epoch, the micro-batch size and the global batch.

The world size is not an input, which is what lets a run resume or resize mid-epoch
without training a row twice or skipping one.

How one epoch is cut:
1. **Row groups are shuffled.** Their order is redrawn every epoch. The rows, group after
   group in that order, form the epoch's *sequence*.
2. **The sequence is cut into lanes.** There are `per_step` lanes (global batch / micro), each
   a contiguous run of `steps * micro` rows, where `steps` is the number of whole global
   batches in the data. What is left at the end, fewer rows than one global batch, is the
   epoch's *tail*: it is not trained this epoch (and it is other rows next epoch).
3. **Rows are mixed inside windows.** Each lane is cut into windows of `window` rows, and
   each window's rows are permuted. A window spans several row groups, so rows are mixed
   across row groups, not only inside one.
4. **Micro-batches are dealt out.** Lane `c`'s `j`-th run of `micro` rows is global
   micro-batch `c + per_step * j`: it belongs to optimizer step `j`, and a world of `w`
   ranks (w divides per_step) trains it on rank `c mod w`.

So a rank reads only its own lanes, a window at a time, opening at most one row group on
each side of a lane beyond its share. A resume opens the window that holds its position.
Nothing is stored: every part is recomputed from seeded generators on every rank.

What the windows cost in shuffle quality: two rows of one row group land in the same global
batch with a chance of about micro / window (they share a lane and, within a window, a
micro-batch), against about global_batch / rows for a uniform permutation; the two agree
when a window holds a whole lane. See tests/unit/test_epoch_plan.py for measured numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from shoal.data.manifest import Manifest

ORDER_STREAM, WINDOW_STREAM = 1, 2  # keep the group order's and the windows' random draws apart


@dataclass(frozen=True)
class Piece:
    """Rows `start:stop` (within the group) of row group `group` (an index into the manifest)."""

    group: int
    start: int
    stop: int


@dataclass(frozen=True)
class Window:
    """Rows `first:first + rows` of one lane: where to read them, and how they are mixed."""

    lane: int
    index: int
    first: int  # the window's first row, counted from the lane's start
    pieces: tuple[Piece, ...]  # in sequence order; their rows concatenated are the window's rows
    mix: np.ndarray  # the window's rows in training order, as positions into the concatenation

    @property
    def rows(self) -> int:
        return len(self.mix)

    def micro_batch_positions(self, j: int, micro: int) -> np.ndarray:
        """Positions (into the concatenated pieces) of the lane's `j`-th micro-batch."""
        start = j * micro - self.first
        return self.mix[start : start + micro]


@dataclass(frozen=True)
class EpochPlan:
    group_rows: tuple[int, ...]  # rows per row group, in manifest order
    digest: str  # the manifest's: different data, a different plan
    seed: int
    epoch: int
    micro: int
    global_batch: int
    window_rows: int  # rows mixed at a time in each lane; 0: no shuffle at all

    def __post_init__(self) -> None:
        if self.micro <= 0 or self.global_batch % self.micro:
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of micro-batch {self.micro}"
            )

    # -- the epoch's shape --------------------------------------------------------------
    @property
    def per_step(self) -> int:
        return self.global_batch // self.micro

    @cached_property
    def total_rows(self) -> int:
        return sum(self.group_rows)

    @property
    def steps(self) -> int:
        """Optimizer steps in the epoch: whole global batches only."""
        return self.total_rows // self.global_batch

    @property
    def micro_batches(self) -> int:
        return self.steps * self.per_step

    @property
    def lane_rows(self) -> int:
        return self.steps * self.micro

    @property
    def shuffled(self) -> bool:
        return self.window_rows > 0

    @property
    def window(self) -> int:
        """Rows per window: whole micro-batches, at most one lane (at least one micro-batch)."""
        wanted = max(self.micro, self.window_rows // self.micro * self.micro)
        return min(wanted, self.lane_rows) if self.lane_rows else wanted

    def windows_in_lane(self) -> int:
        return -(-self.lane_rows // self.window) if self.lane_rows else 0

    # -- the sequence ---------------------------------------------------------------------
    def _generator(self, *stream: int) -> np.random.Generator:
        entropy = [int(self.digest[:16] or "0", 16), self.seed, self.epoch, *stream]
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))

    @cached_property
    def group_order(self) -> np.ndarray:
        """Row-group indices in the order this epoch reads them."""
        count = len(self.group_rows)
        if not self.shuffled:
            return np.arange(count)
        return self._generator(ORDER_STREAM).permutation(count)

    @cached_property
    def _sequence_starts(self) -> np.ndarray:
        """Where each group (in this epoch's order) starts in the sequence; one more for the end."""
        rows = np.asarray(self.group_rows, dtype=np.int64)[self.group_order]
        return np.concatenate([[0], np.cumsum(rows)])

    @cached_property
    def _first_rows(self) -> np.ndarray:
        """Global row id of each group's first row (manifest order)."""
        return np.concatenate([[0], np.cumsum(np.asarray(self.group_rows, dtype=np.int64))])[:-1]

    def pieces(self, start: int, stop: int) -> tuple[Piece, ...]:
        """The row groups (and rows within them) holding sequence positions `start:stop`."""
        starts = self._sequence_starts
        found, t = [], int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            group_start, group_stop = int(starts[t]), int(starts[t + 1])
            end = min(stop, group_stop)
            if end > start:
                found.append(Piece(int(self.group_order[t]), start - group_start, end - group_start))
            start, t = end, t + 1
        return tuple(found)

    # -- lanes and windows --------------------------------------------------------------
    def lane_window(self, lane: int, index: int) -> Window:
        """Window `index` of lane `lane`: its row groups and its mixing."""
        first = index * self.window
        rows = min(self.window, self.lane_rows - first)
        if not 0 <= lane < self.per_step or rows <= 0:
            raise IndexError(f"no window {index} in lane {lane} of this epoch")
        start = lane * self.lane_rows + first
        mix = (
            self._generator(WINDOW_STREAM, lane, index).permutation(rows)
            if self.shuffled
            else np.arange(rows)
        )
        return Window(lane, index, first, self.pieces(start, start + rows), mix)

    def window_of(self, lane: int, j: int) -> int:
        """The window of lane `lane` that holds its `j`-th micro-batch."""
        return j * self.micro // self.window

    def row_ids(self, window: Window) -> np.ndarray:
        """Global row ids of a window's rows, in sequence order (before mixing)."""
        return self._ids(window.pieces)

    def _ids(self, pieces: tuple[Piece, ...]) -> np.ndarray:
        ranges = [np.arange(p.start, p.stop) + self._first_rows[p.group] for p in pieces]
        return np.concatenate(ranges or [np.empty(0, int)])

    def micro_batch_rows(self, index: int) -> np.ndarray:
        """Global row ids of global micro-batch `index` of the epoch, in training order."""
        if not 0 <= index < self.micro_batches:
            raise IndexError(f"micro-batch {index} is outside this epoch's {self.micro_batches}")
        lane, j = index % self.per_step, index // self.per_step
        window = self.lane_window(lane, self.window_of(lane, j))
        return self.row_ids(window)[window.micro_batch_positions(j, self.micro)]

    def tail_rows(self) -> np.ndarray:
        """Global row ids this epoch leaves out (fewer than one global batch)."""
        return self._ids(self.pieces(self.per_step * self.lane_rows, self.total_rows))


def plan_for(
    manifest: Manifest, seed: int, epoch: int, micro: int, global_batch: int, window_rows: int
) -> EpochPlan:
    """The plan of one epoch over a manifest's rows."""
    rows = tuple(g.rows for g in manifest.row_groups)
    return EpochPlan(rows, manifest.digest, seed, epoch, micro, global_batch, window_rows)
