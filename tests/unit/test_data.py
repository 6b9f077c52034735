"""Built-in corpora: deterministic preparation into parquet shards."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from shoal.data import prepare
from shoal.data.builtin import read_manifest


def table_of(directory: Path):
    return pq.read_table(sorted((directory).glob("*.parquet")))


def digest(directory: Path) -> str:
    hasher = hashlib.sha256()
    for split in ("train", "val"):
        table = pq.read_table(directory / split)
        hasher.update(str(table.to_pydict()).encode())
    return hasher.hexdigest()


def test_digits_split_is_complete_and_disjoint(tmp_path: Path) -> None:
    root = prepare("digits", tmp_path / "digits")
    train, val = pq.read_table(root / "train"), pq.read_table(root / "val")
    assert (train.num_rows, val.num_rows) == (1438, 359)
    ids = set(train["id"].to_pylist()) | set(val["id"].to_pylist())
    assert ids == set(range(1797))
    x = np.array(train["x"].to_pylist())
    assert x.shape == (1438, 64)
    assert x.min() >= 0 and x.max() <= 1
    assert set(train["y"].to_pylist()) == set(range(10))
    assert read_manifest(root)["rows"] == {"train": 1438, "val": 359}


def test_digits_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = prepare("digits", tmp_path / "a", seed=1)
    b = prepare("digits", tmp_path / "b", seed=1)
    c = prepare("digits", tmp_path / "c", seed=2)
    assert digest(a) == digest(b) != digest(c)


def test_prepare_is_idempotent_and_refuses_foreign_directories(tmp_path: Path) -> None:
    root = prepare("digits", tmp_path / "d")
    stamp = (root / "manifest.json").stat().st_mtime_ns
    assert prepare("digits", root) == root
    assert (root / "manifest.json").stat().st_mtime_ns == stamp
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        prepare("digits", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_pytext_windows_and_file_split(tmp_path: Path) -> None:
    root = prepare("pytext", tmp_path / "p", seq_len=64)
    manifest = read_manifest(root)
    assert manifest["seq_len"] == 64 and manifest["files"]["val"] > 0
    train, val = pq.read_table(root / "train"), pq.read_table(root / "val")
    assert train.num_rows > 100_000 and val.num_rows > 1_000
    first = np.array(train.slice(0, 4)["tokens"].to_pylist(), dtype=np.uint8)
    assert first.shape == (4, 65)
    text = bytes(first[0]).decode("utf-8", errors="replace")
    assert text.isprintable() or "\n" in text
    assert set(train["id"].to_pylist()).isdisjoint(val["id"].to_pylist())


def test_pytext_is_deterministic(tmp_path: Path) -> None:
    a = prepare("pytext", tmp_path / "a", seq_len=32)
    b = prepare("pytext", tmp_path / "b", seq_len=32)
    first = pq.read_table(a / "train" / "part-00000.parquet")
    assert first.equals(pq.read_table(b / "train" / "part-00000.parquet"))


def test_unknown_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown built-in corpus 'imagenet'"):
        prepare("imagenet", tmp_path)


def test_sources_by_directory_glob_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.fs as pafs

    from shoal.data import sources
    from shoal.data.sources import DataError, parquet_files

    root = prepare("digits", tmp_path / "d")
    by_dir = parquet_files(str(root / "train"), "data.train.path")
    by_glob = parquet_files(str(root / "train" / "part-*.parquet"), "data.train.path")
    assert by_dir == by_glob and len(by_dir) == 4
    assert parquet_files(by_dir[0], "data.train.path") == by_dir[:1]
    # An object-store prefix is listed (here a local folder stands in for the bucket)
    shutil.copytree(root / "train", tmp_path / "bucket" / "train")
    (tmp_path / "bucket" / "train" / "notes.txt").write_text("not data")
    bucket = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    from_uri = SimpleNamespace(from_uri=lambda uri: (bucket, uri.split("://")[1]))
    fs = SimpleNamespace(FileSystem=from_uri, FileType=pafs.FileType, FileSelector=pafs.FileSelector)
    monkeypatch.setattr(sources, "pafs", fs)
    listed = [f"s3://bucket/train/{Path(f).name}" for f in by_dir]
    assert parquet_files("s3://bucket/train", "data.train.path") == listed
    assert parquet_files(listed[0], "data.train.path") == listed[:1]
    with pytest.raises(DataError, match="no such object or prefix: 's3://bucket/val'"):
        parquet_files("s3://bucket/val", "data.val.path")
    with pytest.raises(DataError, match="no parquet files found"):
        parquet_files(str(root / "train" / "*.csv"), "data.train.path")
