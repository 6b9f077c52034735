"""The global micro-batch order: exactly-once data across restarts and world-size changes."""

from __future__ import annotations

from collections import Counter

import torch

from shoal.worker.checkpoint.state import Position
from shoal.worker.stream import StreamPlan, micro_batches

ROWS, MICRO, PER_STEP = 100, 4, 6  # 24 rows per optimizer step: 4 whole steps an epoch, 4 rows left over


class EpochShard:
    """Ray Data's iterator contract as shoal uses it: the same seed gives the same order."""

    def iter_torch_batches(self, batch_size, drop_last, local_shuffle_buffer_size, local_shuffle_seed):
        order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(local_shuffle_seed))
        for start in range(0, ROWS - batch_size + 1 if drop_last else ROWS, batch_size):
            yield {"id": order[start : start + batch_size]}


def _plan(rank: int, world: int, skipped: set | None = None) -> StreamPlan:
    return StreamPlan(
        MICRO, PER_STEP, rank, world, epochs=2, shuffle_buffer=16, seed=3, skipped_steps=skipped or set()
    )


def _steps(world: int, position: Position, count: int, skipped: set | None = None) -> list[list[int]]:
    """Ids trained by each of the next `count` optimizer steps, all ranks together."""
    streams = [micro_batches(EpochShard(), _plan(r, world, skipped), position) for r in range(world)]
    steps = []
    for _ in range(count):
        ids = []
        for stream in streams:
            for _ in range(PER_STEP // world):
                ids += next(stream).batch["id"].tolist()
        steps.append(sorted(ids))
    return steps


def test_each_epoch_trains_every_sample_once_at_any_world_size() -> None:
    for world in (1, 2, 3, 6):
        steps = _steps(world, Position(), 8)
        for epoch in (steps[:4], steps[4:]):
            seen = Counter(i for step in epoch for i in step)
            assert len(seen) == 96 and set(seen.values()) == {1}
    assert _steps(1, Position(), 8) == _steps(3, Position(), 8)  # same samples in the same steps


def test_resize_and_resume_continue_where_the_checkpoint_left_off() -> None:
    uninterrupted = _steps(2, Position(), 8)
    # 2 workers train 3 steps, a checkpoint at step 1 (6 micro-batches of epoch 0 consumed);
    # the restart has 3 workers and replays steps 2-3, then goes on into epoch 1.
    resumed = _steps(3, Position(step=1, epoch=0, batches_in_epoch=PER_STEP), 7)
    assert [uninterrupted[0], *resumed] == uninterrupted
    # a checkpoint at the end of an epoch's whole steps resumes in the next epoch
    assert _steps(1, Position(step=4, epoch=0, batches_in_epoch=4 * PER_STEP), 4) == uninterrupted[4:]


def test_skipped_steps_are_left_out_for_every_rank() -> None:
    uninterrupted = _steps(2, Position(), 8)
    skipping = _steps(2, Position(), 7, skipped={(0, 1)})
    assert skipping == [uninterrupted[0], *uninterrupted[2:]]
