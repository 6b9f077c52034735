"""A rank's micro-batches from real parquet (worker/stream.py over data/reader.py): exactly-once
data across restarts and world-size changes, and each rank reading only its share."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shoal.data.errors import DataError
from shoal.data.manifest import Manifest, build_manifest
from shoal.data.reader import ReadCounts, to_tensors
from shoal.worker.checkpoint.state import Position
from shoal.worker.stream import StreamPlan, micro_batches

ROWS, MICRO, PER_STEP = 100, 4, 6  # 24 rows per optimizer step: 4 whole steps an epoch, 4 rows left over


def write_dataset(directory: Path, rows: int, per_group: int, files: int, width: int = 8) -> Manifest:
    """`rows` rows with ids 0.. and a `width`-wide float feature, in `files` parquet files of
    row groups of `per_group` rows."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = np.arange(rows)
    features = np.random.default_rng(0).random((rows, width), dtype=np.float32)
    for index, part in enumerate(np.array_split(ids, files)):
        table = pa.table(
            {
                "id": pa.array(part),
                "x": pa.FixedSizeListArray.from_arrays(pa.array(features[part].ravel()), width),
            }
        )
        pq.write_table(table, directory / f"part-{index:03d}.parquet", row_group_size=per_group)
    return build_manifest(sorted(str(p) for p in directory.glob("*.parquet")))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return write_dataset(tmp_path_factory.mktemp("stream"), ROWS, per_group=10, files=3)


def _plan(rank: int, world: int, skipped: set | None = None, epochs: int = 2) -> StreamPlan:
    return StreamPlan(
        MICRO, PER_STEP, rank, world, epochs, shuffle_buffer=16, seed=3, skipped_steps=skipped or set()
    )


def _steps(manifest: Manifest, world: int, position: Position, count: int, skipped: set | None = None):
    """Ids trained by each of the next `count` optimizer steps, all ranks together."""
    streams = [
        micro_batches(manifest, _plan(r, world, skipped), position, ReadCounts()) for r in range(world)
    ]
    steps = []
    for _ in range(count):
        ids = []
        for stream in streams:
            for _ in range(PER_STEP // world):
                ids += next(stream).batch["id"].tolist()
        steps.append(sorted(ids))
    return steps


def test_each_epoch_trains_every_sample_once_at_any_world_size(manifest: Manifest) -> None:
    for world in (1, 2, 3, 6):
        steps = _steps(manifest, world, Position(), 8)
        for epoch in (steps[:4], steps[4:]):
            seen = Counter(i for step in epoch for i in step)
            assert len(seen) == 96 and set(seen.values()) == {1}
    assert _steps(manifest, 1, Position(), 8) == _steps(manifest, 3, Position(), 8)
    epochs = _steps(manifest, 1, Position(), 8)
    assert epochs[:4] != epochs[4:]  # each epoch is shuffled anew


def test_resize_and_resume_continue_where_the_checkpoint_left_off(manifest: Manifest) -> None:
    uninterrupted = _steps(manifest, 2, Position(), 8)
    # 2 workers train 3 steps, a checkpoint at step 1 (6 micro-batches of epoch 0 consumed);
    # the restart has 3 workers and replays steps 2-3, then goes on into epoch 1.
    resumed = _steps(manifest, 3, Position(step=1, epoch=0, batches_in_epoch=PER_STEP), 7)
    assert [uninterrupted[0], *resumed] == uninterrupted
    # a checkpoint at the end of an epoch's whole steps resumes in the next epoch
    assert (
        _steps(manifest, 1, Position(step=4, epoch=0, batches_in_epoch=4 * PER_STEP), 4) == uninterrupted[4:]
    )


def test_skipped_steps_are_left_out_for_every_rank(manifest: Manifest) -> None:
    uninterrupted = _steps(manifest, 2, Position(), 8)
    skipping = _steps(manifest, 2, Position(), 7, skipped={(0, 1)})
    assert skipping == [uninterrupted[0], *uninterrupted[2:]]


def test_the_epochs_last_step_is_marked(manifest: Manifest) -> None:
    items = list(micro_batches(manifest, _plan(0, 2, epochs=1), Position(), ReadCounts()))
    assert [item.last_of_epoch for item in items] == [False] * 9 + [True] * 3  # 4 steps of 3


def test_each_rank_reads_its_share_of_the_bytes(tmp_path: Path) -> None:
    """10,000 rows of 64 floats in row groups of 40 (31 to a lane): per rank, bytes read within
    10 % of dataset / world (footers included); summed, within 10 % of the dataset."""
    manifest = write_dataset(tmp_path, 10_000, per_group=40, files=4, width=64)
    world, per_step = 4, 8
    counted = []
    for rank in range(world):
        plan = StreamPlan(8, per_step, rank, world, epochs=1, shuffle_buffer=512, seed=1)
        counts = ReadCounts()
        items = list(micro_batches(manifest, plan, Position(), counts))
        assert counts.rows_trained == len(items) * 8 == 10_000 // 64 * 64 // world
        counted.append(counts)
    dataset = sum(f.size for f in manifest.files)
    assert max(c.bytes_read for c in counted) <= 1.10 * dataset / world
    assert sum(c.bytes_read for c in counted) <= 1.10 * dataset
    assert sum(c.rows_decoded for c in counted) <= 1.10 * 10_000


def test_a_resume_late_in_the_epoch_reads_no_more_than_one_early_in_it(tmp_path: Path) -> None:
    manifest = write_dataset(tmp_path, 4_000, per_group=50, files=2)

    def first_batch_bytes(step: int) -> int:
        counts = ReadCounts()
        plan = StreamPlan(8, 4, 0, 2, epochs=1, shuffle_buffer=200, seed=2)
        stream = micro_batches(manifest, plan, Position(step=step, batches_in_epoch=4 * step), counts)
        next(stream)
        return counts.bytes_read

    early, late = first_batch_bytes(12), first_batch_bytes(112)  # 10 % and 90 % of 125 steps
    assert late <= 1.5 * early  # a window each (and its read-ahead), not the epoch before it


def test_too_few_rows_for_one_global_batch_is_a_data_error(tmp_path: Path) -> None:
    manifest = write_dataset(tmp_path, 20, per_group=10, files=1)
    with pytest.raises(DataError, match="fewer than one global batch"):
        next(micro_batches(manifest, _plan(0, 1), Position(), ReadCounts()))


def test_tensors_keep_numeric_columns_and_their_shapes() -> None:
    table = pa.table(
        {
            "tokens": pa.array([[1, 2, 3], [4, 5, 6]], type=pa.list_(pa.uint16())),
            "y": pa.array([0, 1], type=pa.int64()),
            "name": pa.array(["a", "b"]),
        }
    )
    batch = to_tensors(table)
    assert sorted(batch) == ["tokens", "y"]
    assert batch["tokens"].shape == (2, 3) and batch["tokens"].tolist() == [[1, 2, 3], [4, 5, 6]]
