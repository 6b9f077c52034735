"""Reading a rank's lanes of the epoch plan from real parquet (data/lanes.py, data/reader.py):
the rows the plan names, only this rank's share of the bytes, a resume that seeks."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shoal.data.epoch_plan import plan_for
from shoal.data.errors import DataError
from shoal.data.lanes import lanes_of, slot_micro_batches
from shoal.data.manifest import Manifest, build_manifest
from shoal.data.reader import ReadCounts, RowGroupReader, Rows, to_tensors


def write_dataset(directory: Path, rows: int, per_group: int, files: int, width: int = 8) -> Manifest:
    """`rows` rows with ids 0.. and a `width`-wide float feature, in `files` parquet files of
    row groups of `per_group` rows."""
    directory.mkdir(parents=True, exist_ok=True)
    features = np.random.default_rng(0).random((rows, width), dtype=np.float32)
    for index, part in enumerate(np.array_split(np.arange(rows), files)):
        x = pa.FixedSizeListArray.from_arrays(pa.array(features[part].ravel()), width)
        table = pa.table({"id": pa.array(part), "x": x})
        pq.write_table(table, directory / f"part-{index:03d}.parquet", row_group_size=per_group)
    return build_manifest(sorted(str(p) for p in directory.glob("*.parquet")))


def read_epoch(manifest: Manifest, plan, slot: int, dp: int, steps=None, counts=None):
    """{global micro-batch index: ids} of one slot, and what it read."""
    counts = counts or ReadCounts()
    reader = RowGroupReader(manifest, counts)
    with ThreadPoolExecutor(max_workers=1) as loader:
        read = slot_micro_batches(plan, slot, dp, steps or range(plan.steps), reader, loader)
        batches = {index: batch["id"].tolist() for index, batch, _ in read}
    reader.close()
    return batches, counts


def test_every_slot_reads_exactly_the_rows_the_plan_names(tmp_path: Path) -> None:
    manifest = write_dataset(tmp_path, 1_000, per_group=30, files=3)
    plan = plan_for(manifest, seed=5, epoch=1, micro=4, global_batch=24, window_rows=40)
    for dp in (1, 2, 3, 6):
        trained: Counter[int] = Counter()
        for slot in range(dp):
            batches, _ = read_epoch(manifest, plan, slot, dp)
            assert set(batches) == {i for i in range(plan.micro_batches) if i % plan.per_step % dp == slot}
            for index, ids in batches.items():
                assert ids == plan.micro_batch_rows(index).tolist()
                trained.update(ids)
        assert set(trained.values()) == {1}
        assert sorted(trained) == sorted(set(range(1_000)) - set(plan.tail_rows().tolist()))


def test_each_slot_reads_its_share_of_the_bytes(tmp_path: Path) -> None:
    """10,000 rows of 64 floats in row groups of 40, 4 slots of 2 lanes: per slot, bytes read
    within 10 % of dataset / dp (footers included); summed, within 10 % of the dataset."""
    manifest = write_dataset(tmp_path, 10_000, per_group=40, files=4, width=64)
    plan = plan_for(manifest, seed=1, epoch=0, micro=8, global_batch=64, window_rows=512)
    dp, dataset = 4, sum(f.size for f in manifest.files)
    counted = []
    for slot in range(dp):
        batches, counts = read_epoch(manifest, plan, slot, dp)
        assert sum(len(ids) for ids in batches.values()) == plan.micro_batches * 8 // dp
        counted.append(counts)
    assert max(c.bytes_read for c in counted) <= 1.10 * dataset / dp
    assert sum(c.bytes_read for c in counted) <= 1.10 * dataset
    assert sum(c.rows_decoded for c in counted) <= 1.10 * 10_000


def test_a_resume_late_in_the_epoch_reads_no_more_than_one_early_in_it(tmp_path: Path) -> None:
    """Slot 0 of 2 has lanes 0 and 2 of 1,000 rows; its first batch needs a 96-row window of each
    (and reads the next one ahead): 4 windows of whole row groups and both files' footers,
    measured 49 and 45 KB of 248 KB at 10 % and 90 %, where replaying to 90 % of the epoch
    would read 45 % of the dataset."""
    manifest = write_dataset(tmp_path, 4_000, per_group=25, files=2)
    plan = plan_for(manifest, seed=2, epoch=0, micro=8, global_batch=32, window_rows=100)

    def bytes_to_first_batch(step: int) -> int:
        counts = ReadCounts()
        reader = RowGroupReader(manifest, counts)
        with ThreadPoolExecutor(max_workers=1) as loader:
            next(slot_micro_batches(plan, 0, 2, range(step, plan.steps), reader, loader))
        return counts.bytes_read  # the read-ahead included: the loader has finished

    early, late = bytes_to_first_batch(12), bytes_to_first_batch(112)  # 10 % and 90 % of 125 steps
    whole = sum(f.size for f in manifest.files)
    assert late <= 1.2 * early and late < 0.3 * whole, (early, late, whole)


def test_bytes_read_are_the_files_bytes_once_each(tmp_path: Path) -> None:
    """Reading every row group once reads each file once, but for its leading 4-byte magic."""
    manifest = write_dataset(tmp_path, 600, per_group=50, files=2)
    counts = ReadCounts()
    reader = RowGroupReader(manifest, counts)
    ids = [reader.read(g).column("id").to_pylist() for g in range(len(manifest.row_groups))]
    assert sum(ids, []) == list(range(600))
    assert counts.bytes_read == sum(f.size - 4 for f in manifest.files)
    assert counts.rows_decoded == 600
    taken = counts.take()  # an epoch's counts, zeroed for the next
    assert (taken.rows_decoded, counts) == (600, ReadCounts())


def test_a_file_rewritten_after_the_manifest_is_a_data_error_naming_it(tmp_path: Path) -> None:
    manifest = write_dataset(tmp_path, 100, per_group=10, files=1)
    path = manifest.files[0].path
    pq.write_table(pa.table({"id": pa.array(np.arange(100))}), path, row_group_size=20)
    with pytest.raises(DataError, match="the file changed after the manifest was built") as caught:
        RowGroupReader(manifest, ReadCounts()).read(0)
    assert caught.value.path == path
    Path(path).write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot open") as caught:
        RowGroupReader(manifest, ReadCounts()).read(0)
    assert caught.value.path == path


def test_tensors_keep_numeric_columns_and_their_shapes() -> None:
    table = pa.table(
        {
            "tokens": pa.array([[1, 2, 3], [4, 5, 6]], type=pa.list_(pa.uint16())),
            "y": pa.array([0, 1], type=pa.int64()),
            "name": pa.array(["a", "b"]),
            "ragged": pa.array([[1], [2, 3]]),
        }
    )
    batch = to_tensors(table)
    assert sorted(batch) == ["tokens", "y"]
    assert batch["tokens"].shape == (2, 3) and batch["tokens"].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_a_column_ragged_in_a_window_is_a_tensor_in_the_micro_batches_whose_rows_agree() -> None:
    """A window is converted to tensors once; a list column whose lengths differ across the
    window is converted per micro-batch, as to_tensors of that micro-batch would."""
    ragged = pa.array([[1, 2], [3, 4], [5], [6]])
    table = pa.table({"x": ragged, "y": pa.array([0, 1, 2, 3]), "s": list("abcd")})
    rows = Rows.of(table)
    first, second, across = rows.take(0, 2), rows.take(2, 2), rows.take(1, 2)
    assert first["x"].tolist() == [[1, 2], [3, 4]] and second["x"].tolist() == [[5], [6]]
    assert sorted(first) == ["x", "y"] and second["y"].tolist() == [2, 3]
    assert sorted(across) == ["y"]  # [3, 4] and [5]: no tensor
    assert {k: v.tolist() for k, v in to_tensors(table.slice(0, 2)).items()} == {
        k: v.tolist() for k, v in first.items()
    }


def test_lanes_of_a_slot() -> None:
    assert list(lanes_of(1, 3, 6)) == [1, 4]
    with pytest.raises(ValueError, match="cannot share"):
        lanes_of(0, 4, 6)
