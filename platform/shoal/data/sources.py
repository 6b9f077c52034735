"""Where a workload's data lives, checked before launch, and its Ray datasets.

A source is a directory of parquet shards, a glob of parquet files, or an
object-store URI (`s3://...`, passed to Ray Data as is). Built-in corpora are
prepared into the cache on first use; raw text (jsonl, txt, parquet with a text
column) is packed into token windows in the cache by data/text.py.
"""

from __future__ import annotations

import glob
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shoal.data.builtin import cache_root, prepare
from shoal.data.errors import DataError
from shoal.data.manifest import Manifest, coarse_row_groups, load_or_build_manifest
from shoal.data.text import PackProgress, TextPlan, plan_text

TASK_COLUMNS = {"classify": ("x", "y"), "lm": ("tokens",)}  # without data.columns
DIGITS_FEATURES = 64
CACHE_LIMIT_BYTES = 512 * 1024**2


@dataclass
class DataPlan:
    train: list[str]
    val: list[str] | None
    task: str
    cache: bool
    text: TextPlan | None = None  # raw text: packed into the cache (data/text.py)


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def parquet_files(path: str, where: str) -> list[str]:
    """The parquet files a source names (an object-store prefix listed), or a DataError."""
    if _is_remote(path):
        return _remote_parquet_files(path, where)
    local = path.removeprefix("file://")
    if any(ch in local for ch in "*?["):
        files = sorted(glob.glob(local, recursive=True))
    elif Path(local).is_dir():
        files = sorted(str(p) for p in Path(local).rglob("*.parquet"))
    elif Path(local).is_file():
        files = [local]
    else:
        raise DataError(where, f"no such file or directory: '{path}'")
    if not files:
        raise DataError(where, f"no parquet files found at '{path}'")
    return [str(Path(f).resolve()) for f in files]


def _remote_parquet_files(uri: str, where: str) -> list[str]:
    """An object-store URI's parquet files: the object itself, or every `.parquet` under the
    prefix (credentials and endpoint from the usual AWS_* variables, AWS_ENDPOINT_URL included)."""
    scheme = uri.split("://", 1)[0]
    try:
        filesystem, within = pafs.FileSystem.from_uri(uri)
        info = filesystem.get_file_info(within)
        if info.type == pafs.FileType.File:
            return [uri]
        if info.type == pafs.FileType.NotFound:
            raise DataError(where, f"no such object or prefix: '{uri}'")
        listed = filesystem.get_file_info(pafs.FileSelector(within, recursive=True))
    except (OSError, pa.ArrowException) as exc:
        raise DataError(where, f"cannot list '{uri}': {exc}") from None
    files = sorted(
        f"{scheme}://{i.path}" for i in listed if i.type == pafs.FileType.File and i.path.endswith(".parquet")
    )
    if not files:
        raise DataError(where, f"no parquet files found at '{uri}'")
    return files


def window_length(data_seq_len: int | None, model_args: dict[str, Any]) -> int | None:
    """Tokens per language-model example: `data.seq_len`, else (older workloads)
    `model.args.seq_len`."""
    return data_seq_len or model_args.get("seq_len")


def required_columns(task: str, columns: dict[str, str]) -> list[str]:
    """The columns the data must have: those data.columns names, else the task's own
    (custom without data.columns: whatever the forward takes, checked against its signature)."""
    return list(columns) if columns else list(TASK_COLUMNS.get(task, ()))


def _check_columns(files: list[str], task: str, columns: dict[str, str], where: str) -> None:
    if _is_remote(files[0]):
        return
    try:
        present = set(pq.read_schema(files[0]).names)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(where, f"cannot read parquet file '{files[0]}': {exc}") from None
    missing = [c for c in required_columns(task, columns) if c not in present]
    if missing:
        needed_by = "named in data.columns" if columns else f"needed for task '{task}'"
        raise DataError(where, f"'{files[0]}' lacks column(s) {missing} {needed_by} (has {sorted(present)})")


def column_shapes(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each numeric column's per-row shape and numpy dtype name, from a local parquet file's
    schema (its first row read for the length of variable-length lists). Other columns
    (strings, structs), and lists whose length no row shows, are left out."""
    file = pq.ParquetFile(path)
    first = next(file.iter_batches(batch_size=1), None)
    row = first.to_pylist()[0] if first is not None and first.num_rows else {}
    shapes = {}
    for field in file.schema_arrow:
        shape: list[int] = []
        kind, value = field.type, row.get(field.name)
        while pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            if pa.types.is_fixed_size_list(kind):
                shape.append(kind.list_size)
            elif isinstance(value, list):
                shape.append(len(value))
            else:
                break
            value = value[0] if isinstance(value, list) and value else None
            kind = kind.value_type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            shapes[field.name] = (tuple(shape), np.dtype(kind.to_pandas_dtype()).name)
    return shapes


def builtin_shapes(name: str, seq_len: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """A built-in corpus's columns (data/builtin.py), without preparing it."""
    if name == "digits":
        return {"id": ((), "int64"), "x": ((DIGITS_FEATURES,), "float32"), "y": ((), "int64")}
    return {"id": ((), "int64"), "tokens": (((seq_len or 0) + 1,), "uint8")}


def _total_bytes(files: list[str]) -> int:
    return sum(Path(f).stat().st_size for f in files if not _is_remote(f))


def plan_data(
    data: dict[str, Any],
    model: dict[str, Any],
    task: str,
    prepare_builtin: bool,
    tokenizer: dict[str, Any] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> DataPlan:
    """Resolve the data section into file lists (preparing a built-in corpus, packing raw text, if asked)."""
    builtin = data.get("builtin")
    progress = PackProgress(say=on_progress) if on_progress else None
    text = plan_text(data, model, task, tokenizer, prepare_builtin, progress)
    if text is not None:
        train, val = text.train, text.val
    elif builtin is not None:
        expected = "classify" if builtin == "digits" else "lm"
        if task not in (expected, "custom"):
            raise DataError(
                "data.builtin",
                f"'{builtin}' is a corpus for task '{expected}', but the model's task is '{task}'",
            )
        seq_len = window_length(data.get("seq_len"), model.get("args", {}))
        if builtin == "pytext" and seq_len is None:
            raise DataError(
                "data.seq_len",
                "the 'pytext' corpus is cut into windows of data.seq_len + 1 tokens: set data.seq_len "
                "(or, as older workloads do, model.args.seq_len)",
            )
        if not prepare_builtin:
            return DataPlan([], None, task, cache=True)
        root = prepare(builtin, seq_len=seq_len or 128)  # digits: no windows
        train = parquet_files(str(root / "train"), "data.builtin")
        val = parquet_files(str(root / "val"), "data.builtin")
    else:
        train = parquet_files(data["train"]["path"], "data.train.path")
        columns = data.get("columns") or {}
        _check_columns(train, task, columns, "data.train.path")
        val = None
        if data.get("val"):
            val = parquet_files(data["val"]["path"], "data.val.path")
            _check_columns(val, task, columns, "data.val.path")
    cache = data.get("cache", "auto")
    if cache == "auto":
        remote = any(_is_remote(f) for f in val or [])
        cache = not remote and _total_bytes(val or []) < CACHE_LIMIT_BYTES
    return DataPlan(train, val, task, cache=bool(cache), text=text)


def training_manifest(plan: DataPlan) -> Manifest:
    """The training files' manifest (data/manifest.py), from the cache when they are unchanged."""
    return load_or_build_manifest(plan.train, cache_root() / "manifests")


def row_group_warning(plan: DataPlan, micro: int, global_batch: int, window_rows: int) -> str | None:
    """The coarse-row-group warning (data/manifest.py) for a planned training set; None for a
    fine one, or when its files are not there yet (a built-in corpus or raw text unprepared)."""
    if not plan.train:
        return None
    return coarse_row_groups(training_manifest(plan), micro, global_batch, window_rows)


def validation_manifest(plan: DataPlan) -> Manifest | None:
    """The validation files' manifest, like the training set's; None without a validation set."""
    return load_or_build_manifest(plan.val, cache_root() / "manifests") if plan.val else None
