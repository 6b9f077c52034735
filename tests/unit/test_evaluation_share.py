"""Each evaluation's validation rows, slot by slot (data/evaluation.py): every row exactly
once at any world size, each slot reading only its own share of the row groups."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from shoal.data.evaluation import evaluation_batches, slot_batches
from shoal.data.reader import ReadCounts, RowGroupReader
from tests.unit.test_lanes import write_dataset


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 8, 40])
@pytest.mark.parametrize("whole_only", [False, True])
def test_the_slots_share_out_every_batch_once(slots: int, whole_only: bool) -> None:
    """101 rows in batches of 8: 13 batches, the last of 5 rows (left out with `whole_only`)."""
    batches = [list(slot_batches(101, 8, slot, slots, None, whole_only)) for slot in range(slots)]
    everyone = [b for share in batches for b in share]
    assert everyone == list(range(12 if whole_only else 13))  # each once, in order
    assert max(map(len, batches)) - min(map(len, batches)) <= 1


def test_a_batch_limit_takes_the_first_batches_whatever_the_world_size() -> None:
    for slots in (1, 2, 3, 4):
        shares = [b for slot in range(slots) for b in slot_batches(1_000, 10, slot, slots, 7, False)]
        assert shares == list(range(7))


def test_a_slot_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="slot 2 of 2"):
        slot_batches(100, 8, 2, 2, None, False)


@pytest.mark.parametrize("slots", [1, 2, 3, 7])
def test_every_validation_row_is_evaluated_exactly_once(tmp_path: Path, slots: int) -> None:
    """503 rows in 3 files of row groups of 7 rows, batches of 8: the slots' batches hold each
    id once, in manifest order; each slot decodes its own rows plus at most one row group at
    each end of its share, and reads its share of the row groups' bytes, one more group at
    each end and the footers of the files it opens."""
    manifest = write_dataset(tmp_path, 503, per_group=7, files=3)
    data_bytes = sum(g.bytes for g in manifest.row_groups)
    footers = sum(f.size for f in manifest.files) - data_bytes
    biggest = max(g.bytes for g in manifest.row_groups)
    seen: Counter[int] = Counter()
    ordered: list[int] = []
    for slot in range(slots):
        counts = ReadCounts()
        reader = RowGroupReader(manifest, counts)
        batches = list(evaluation_batches(manifest, reader, 8, slot, slots))
        reader.close()
        ids = [i for batch in batches for i in batch.column("id").to_pylist()]
        seen.update(ids)
        ordered += ids
        assert all(b.num_rows == 8 for b in batches[:-1])
        assert counts.rows_decoded <= len(ids) + 2 * 7
        assert counts.bytes_read <= data_bytes / slots + 2 * biggest + footers
    assert ordered == list(range(503)) and set(seen.values()) == {1}


def test_pipelines_leave_out_the_short_last_batch(tmp_path: Path) -> None:
    manifest = write_dataset(tmp_path, 50, per_group=7, files=1)
    reader = RowGroupReader(manifest, ReadCounts())
    rows = [b.num_rows for b in evaluation_batches(manifest, reader, 8, 0, 1, whole_only=True)]
    assert rows == [8] * 6
