"""Dataset manifests (data/manifest.py): footers only, a digest that follows the content, a cache."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from shoal.data.errors import DataError
from shoal.data.manifest import (
    DataChangedError,
    Manifest,
    ManifestFile,
    build_manifest,
    check_resume,
    coarse_row_groups,
    dataset_root,
    load_or_build_manifest,
)
from shoal.errors import ShoalError

FILE_ROWS = (230, 170, 301)  # three files, several row groups each
GROUP_ROWS = 64


def write_file(path: Path, first_id: int, rows: int, group_rows: int = GROUP_ROWS, payload: int = 8) -> None:
    rng = np.random.default_rng(first_id)
    ids = pa.array(range(first_id, first_id + rows), pa.int64())
    blobs = pa.array([rng.bytes(payload) for _ in range(rows)], pa.binary())  # incompressible
    pq.write_table(pa.table({"id": ids, "blob": blobs}), path, row_group_size=group_rows)


def write_dataset(root: Path, file_rows: tuple[int, ...] = FILE_ROWS, **kwargs) -> list[str]:
    """Parquet files whose `id` column numbers the rows 0.. across the files in name order."""
    root.mkdir(parents=True, exist_ok=True)
    paths, first_id = [], 0
    for n, rows in enumerate(file_rows):
        path = root / f"part-{n:05d}.parquet"
        write_file(path, first_id, rows, **kwargs)
        paths.append(str(path))
        first_id += rows
    return paths


def footer_facts(path: str) -> list[tuple[int, int]]:
    metadata = pq.ParquetFile(path).metadata
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]
    return [
        (g.num_rows, sum(g.column(c).total_compressed_size for c in range(g.num_columns))) for g in groups
    ]


def test_row_groups_match_the_footers(tmp_path: Path) -> None:
    files = write_dataset(tmp_path / "data")
    manifest = build_manifest(list(reversed(files)))
    assert [f.path for f in manifest.files] == sorted(files)
    assert [f.size for f in manifest.files] == [os.path.getsize(f) for f in sorted(files)]
    for i, path in enumerate(sorted(files)):
        facts = footer_facts(path)
        assert len(facts) > 1
        assert manifest.groups_of(i) == facts
        assert [g.index for g in manifest.row_groups if g.file == i] == list(range(len(facts)))
    assert manifest.total_rows == sum(FILE_ROWS)
    assert manifest.total_bytes == sum(b for f in files for _, b in footer_facts(f)) > 0


def test_global_row_ids_are_contiguous_and_match_the_rows(tmp_path: Path) -> None:
    manifest = build_manifest(write_dataset(tmp_path / "data"))
    expected_first = 0
    for group in manifest.row_groups:
        assert group.first_row == expected_first
        expected_first += group.rows
        ids = pq.ParquetFile(manifest.files[group.file].path).read_row_group(group.index, columns=["id"])
        assert ids["id"].to_pylist() == list(range(group.first_row, group.first_row + group.rows))
    assert expected_first == manifest.total_rows


class CountingHandler(pafs.FileSystemHandler):
    """The local filesystem, counting the bytes read from each file."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()
        self.bytes_read: dict[str, int] = {}

    def open_input_file(self, path: str) -> pa.PythonFile:
        handler = self

        class Counted(io.FileIO):
            def read(self, size: int = -1) -> bytes:
                data = super().read(size)
                handler.bytes_read[path] = handler.bytes_read.get(path, 0) + len(data)
                return data

        return pa.PythonFile(Counted(path, "rb"), mode="r")

    def get_type_name(self) -> str:
        return "counting"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)

    def _read_only(self, *args: object) -> None:
        raise NotImplementedError("read-only in this test")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
    delete_file = move = copy_file = _read_only
    open_input_stream = open_output_stream = open_append_stream = _read_only


def test_only_footers_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = write_dataset(tmp_path / "data", file_rows=(4000, 3000), group_rows=500, payload=100)
    expected = build_manifest(files)

    def no_column_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("column data read")

    for name in ("read", "read_row_group", "read_row_groups", "iter_batches", "scan_contents"):
        monkeypatch.setattr(pq.ParquetFile, name, no_column_data)
    monkeypatch.setattr(pq, "read_table", no_column_data)
    handler = CountingHandler()
    manifest = build_manifest(files, filesystem=pafs.PyFileSystem(handler))

    assert manifest == expected
    for path in files:  # a footer and at most pyarrow's one speculative tail read
        assert 0 < handler.bytes_read[path] <= 64 * 1024 + pq.read_metadata(path).serialized_size + 8
        assert handler.bytes_read[path] < os.path.getsize(path) / 4


def test_digest_is_stable_and_moves_with_the_data(tmp_path: Path) -> None:
    files = write_dataset(tmp_path / "data")
    first, second = build_manifest(files), build_manifest(files)
    assert first == second and len(first.digest) == 64

    elsewhere = tmp_path / "another" / "folder"
    shutil.copytree(tmp_path / "data", elsewhere)
    for path in elsewhere.iterdir():
        os.utime(path, ns=(1, 1))  # other modification times too
    moved = build_manifest([str(p) for p in elsewhere.iterdir()])
    assert moved.files != first.files
    assert moved.digest == first.digest


def test_a_bucket_with_the_same_files_has_the_same_digest() -> None:
    groups = [[(10, 100), (5, 50)], [(7, 70)]]
    local = [ManifestFile("/data/ds/a.parquet", 900, "1"), ManifestFile("/data/ds/sub/b.parquet", 800, "2")]
    bucket = [
        ManifestFile("s3://bucket/ds/a.parquet", 900, ""),
        ManifestFile("s3://bucket/ds/sub/b.parquet", 800, ""),
    ]
    assert dataset_root([f.path for f in bucket]) == "s3://bucket/ds/"
    assert Manifest.from_groups(local, groups).digest == Manifest.from_groups(bucket, groups).digest
    renamed = [
        ManifestFile("s3://bucket/ds/a.parquet", 900, ""),
        ManifestFile("s3://bucket/ds/sub/c.parquet", 800, ""),
    ]
    assert Manifest.from_groups(renamed, groups).digest != Manifest.from_groups(bucket, groups).digest


@pytest.mark.parametrize("change", ["add a row", "remove a file", "rename a file", "regroup the rows"])
def test_digest_changes_with_the_content(tmp_path: Path, change: str) -> None:
    root = tmp_path / "data"
    files = write_dataset(root)
    before = build_manifest(files)
    if change == "add a row":
        write_file(Path(files[1]), FILE_ROWS[0], FILE_ROWS[1] + 1)
    elif change == "remove a file":
        os.remove(files.pop())
    elif change == "rename a file":
        files[2] = str(Path(files[2]).rename(root / "renamed.parquet"))
    else:
        write_file(Path(files[0]), 0, FILE_ROWS[0], group_rows=GROUP_ROWS * 2)
    assert build_manifest(files).digest != before.digest


def test_json_round_trip_and_tampering(tmp_path: Path) -> None:
    manifest = build_manifest(write_dataset(tmp_path / "data"))
    assert Manifest.from_json(manifest.to_json()) == manifest
    data = json.loads(manifest.to_json())
    data["files"][0]["row_groups"][0][0] += 1
    with pytest.raises(ValueError, match="digest"):
        Manifest.from_json(json.dumps(data))


def spy_on_footers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = pq.read_metadata

    def counted(where: str, *args: object, **kwargs: object) -> pq.FileMetaData:
        calls.append(where)
        return original(where, *args, **kwargs)

    monkeypatch.setattr(pq, "read_metadata", counted)
    return calls


def test_a_cache_hit_reads_no_footer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files, cache = write_dataset(tmp_path / "data"), tmp_path / "cache"
    calls = spy_on_footers(monkeypatch)
    built = load_or_build_manifest(files, cache)
    assert len(calls) == len(files)
    assert len(list(cache.glob("manifest-*.json"))) == 1

    loaded = load_or_build_manifest(files, cache)
    assert len(calls) == len(files)
    assert loaded == built == build_manifest(files)


def test_a_changed_file_misses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files, cache = write_dataset(tmp_path / "data"), tmp_path / "cache"
    before = load_or_build_manifest(files, cache)
    write_file(Path(files[0]), 0, FILE_ROWS[0] - 1)
    calls = spy_on_footers(monkeypatch)
    after = load_or_build_manifest(files, cache)
    assert len(calls) == len(files)
    assert after.digest != before.digest
    assert after == build_manifest(files)


@pytest.mark.parametrize("damage", ["truncated", "not json", "tampered digest", "empty"])
def test_a_corrupt_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    files, cache = write_dataset(tmp_path / "data"), tmp_path / "cache"
    built = load_or_build_manifest(files, cache)
    (cache_file,) = cache.glob("manifest-*.json")
    text = cache_file.read_text()
    damaged = {
        "truncated": text[: len(text) // 2],
        "not json": "\x00\x01garbage",
        "tampered digest": text.replace(built.digest, "0" * 64),
        "empty": "",
    }[damage]
    cache_file.write_text(damaged)
    calls = spy_on_footers(monkeypatch)

    assert load_or_build_manifest(files, cache) == built
    assert len(calls) == len(files)
    assert Manifest.from_json(cache_file.read_text()) == built


def test_a_failed_cache_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files, cache = write_dataset(tmp_path / "data"), tmp_path / "cache"

    def killed(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        load_or_build_manifest(files, cache)
    assert list(cache.iterdir()) == []


def test_files_that_cannot_be_read_are_named(tmp_path: Path) -> None:
    files = write_dataset(tmp_path / "data")
    with pytest.raises(DataError, match="no such file") as missing:
        build_manifest([*files, str(tmp_path / "data" / "gone.parquet")])
    assert missing.value.where == str(tmp_path / "data" / "gone.parquet")

    (tmp_path / "data" / "notes.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read the parquet footer") as unreadable:
        build_manifest([*files, str(tmp_path / "data" / "notes.parquet")])
    assert unreadable.value.where == str(tmp_path / "data" / "notes.parquet")

    with pytest.raises(DataError, match="listed twice"):
        build_manifest([*files, os.path.relpath(files[0])])


def test_resume_on_changed_data_is_refused_with_the_way_to_accept_it(tmp_path: Path) -> None:
    manifest = build_manifest(write_dataset(tmp_path / "data"))
    recorded = "ab12cd34ef56" + "0" * 52
    check_resume(manifest.digest, manifest.digest, accept_changed=False)
    check_resume(recorded, manifest.digest, accept_changed=True)

    with pytest.raises(DataChangedError) as refused:
        check_resume(recorded, manifest.digest, accept_changed=False)
    error = refused.value
    assert isinstance(error, ShoalError) and error.exit_code == 2
    assert error.where == "data.train.path"
    (line,) = error.lines()
    assert recorded[:12] in line and manifest.digest[:12] in line
    assert "data.accept_changed_data: true" in line


def synthetic(groups: int, rows: int) -> Manifest:
    return Manifest.from_groups([ManifestFile("/d/a.parquet", 1, "")], [[(rows, rows * 10)] * groups])


def test_one_big_row_group_is_too_coarse(tmp_path: Path) -> None:
    (path,) = write_dataset(tmp_path / "data", file_rows=(2000,), group_rows=2000)
    manifest = build_manifest([path])
    assert len(manifest.row_groups) == 1
    warning = coarse_row_groups(manifest, micro_batch_rows=8, global_batch=32, window_rows=8192)
    assert warning is not None and "\n" not in warning
    # 62 whole global batches: 4 lanes of 496 rows, 20 row groups of 24 rows each would do
    assert "median 2000 rows per row group (want <= 24" in warning
    assert warning.endswith("shoal data pack SRC DST --rows-per-group 24")


def test_fine_row_groups_get_no_warning(tmp_path: Path) -> None:
    manifest = build_manifest(write_dataset(tmp_path / "data", file_rows=(640, 640), group_rows=16))
    assert len(manifest.row_groups) == 80
    assert coarse_row_groups(manifest, micro_batch_rows=8, global_batch=32, window_rows=8192) is None


def test_coarse_rule_limits() -> None:
    # 2,000 rows, global batch 32 (4 lanes of 496 rows): at most 24 rows per group
    assert coarse_row_groups(synthetic(80, 25), 8, 32, window_rows=8192) is not None
    assert coarse_row_groups(synthetic(100, 20), 8, 32, window_rows=8192) is None
    assert coarse_row_groups(synthetic(250, 8), 8, 32, window_rows=8192) is None
    # a shuffle window of 30 rows wants row groups of at most 15
    assert "want <= 15" in (coarse_row_groups(synthetic(100, 20), 8, 32, window_rows=30) or "")
    assert coarse_row_groups(synthetic(100, 20), 8, 32, window_rows=0) is None  # no shuffle: reading only
    assert coarse_row_groups(synthetic(0, 0), 8, 32, window_rows=8192) is None
    assert coarse_row_groups(synthetic(1, 20), 8, 32, window_rows=8192) is None  # not one global batch
