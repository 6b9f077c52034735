"""Which validation rows each data-parallel slot evaluates: every row exactly once per
evaluation, at any world size.

The validation set, in manifest order, is cut into batches of `batch_rows` rows (the last
one may be shorter). Slot `s` of `slots` evaluates a contiguous run of them, so it opens
only its own share of the row groups (plus at most one at each end). Ranks sharing a slot
(tensor x pipeline parallel) evaluate the same batches. `max_batches` takes the first
batches of the whole set, whatever the world size.

Ray Data's split, which served validation before, gives every worker the same number of
rows (`streaming_split(equal=True)`), dropping up to world - 1 rows from each evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from shoal.data.manifest import Manifest
from shoal.data.reader import RowGroupReader


def slot_batches(
    total_rows: int, batch_rows: int, slot: int, slots: int, max_batches: int | None, whole_only: bool
) -> range:
    """Global indices of the batches slot `slot` evaluates. `whole_only` leaves out a short
    last batch (pipeline schedules need every batch the same shape)."""
    if batch_rows <= 0 or not 0 <= slot < slots:
        raise ValueError(f"slot {slot} of {slots} with batches of {batch_rows} rows")
    count = total_rows // batch_rows if whole_only else -(-total_rows // batch_rows)
    if max_batches is not None:
        count = min(count, max_batches)
    return range(slot * count // slots, (slot + 1) * count // slots)


def batch_rows_of(manifest: Manifest, batch_rows: int, index: int) -> tuple[int, int]:
    """Rows `start:stop` of batch `index`, in manifest order."""
    start = index * batch_rows
    return start, min(start + batch_rows, manifest.total_rows)


def evaluation_batches(
    manifest: Manifest,
    reader: RowGroupReader,
    batch_rows: int,
    slot: int,
    slots: int,
    max_batches: int | None = None,
    whole_only: bool = False,
) -> Iterator[pa.Table]:
    """This slot's validation batches, read from whole row groups, each group once."""
    first_rows = np.concatenate([[0], np.cumsum([g.rows for g in manifest.row_groups])])
    cached: tuple[int, pa.Table] | None = None
    for index in slot_batches(manifest.total_rows, batch_rows, slot, slots, max_batches, whole_only):
        start, stop = batch_rows_of(manifest, batch_rows, index)
        pieces = []
        group = int(np.searchsorted(first_rows, start, side="right")) - 1
        while start < stop:
            if cached is None or cached[0] != group:
                cached = (group, reader.read(group))
            group_start, group_stop = int(first_rows[group]), int(first_rows[group + 1])
            end = min(stop, group_stop)
            pieces.append(cached[1].slice(start - group_start, end - start))
            start, group = end, group + 1
        yield pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
