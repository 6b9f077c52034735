"""Micro-batches across epochs from a Ray Data shard, resumable by position."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shoal.worker.checkpoint import Position


def micro_batches(
    shard: Any,
    micro: int,
    position: Position,
    epochs: int | None,
    shuffle_buffer: int,
    seed: int,
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Yield (epoch, index within epoch starting at 1, batch), forever or for `epochs`.

    A resumed run starts at `position.epoch` and skips the micro-batches this rank
    already consumed there. Each epoch is re-split by Ray Data, so which rows a
    rank gets differs between attempts; the count of rows skipped is exact.
    """
    epoch, skip = position.epoch, position.batches_in_epoch
    while epochs is None or epoch < epochs:
        batches = shard.iter_torch_batches(
            batch_size=micro,
            drop_last=True,
            local_shuffle_buffer_size=shuffle_buffer or None,
            local_shuffle_seed=(seed * 100_003 + epoch) if shuffle_buffer else None,
        )
        index = 0
        for batch in batches:
            index += 1
            if index <= skip:
                continue
            yield epoch, index, batch
        epoch, skip = epoch + 1, 0
