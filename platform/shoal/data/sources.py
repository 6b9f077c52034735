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

import pyarrow.parquet as pq

from shoal.data.builtin import prepare
from shoal.data.errors import DataError
from shoal.data.text import PackProgress, TextPlan, plan_text

REQUIRED_COLUMNS = {"classify": ("x", "y"), "lm": ("tokens",)}
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
    """The parquet files a source names (remote URIs unexpanded), or a DataError."""
    if _is_remote(path):
        return [path]
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


def _check_columns(files: list[str], task: str, where: str) -> None:
    if _is_remote(files[0]):
        return
    try:
        columns = set(pq.read_schema(files[0]).names)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(where, f"cannot read parquet file '{files[0]}': {exc}") from None
    missing = [c for c in REQUIRED_COLUMNS[task] if c not in columns]
    if missing:
        raise DataError(
            where,
            f"'{files[0]}' lacks column(s) {missing} needed for task '{task}' (has {sorted(columns)})",
        )


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
        if task != expected:
            raise DataError(
                "data.builtin",
                f"'{builtin}' is a corpus for task '{expected}', but the model's task is '{task}'",
            )
        seq_len = int(model.get("args", {}).get("seq_len", 128))
        if not prepare_builtin:
            return DataPlan([], None, task, cache=True)
        root = prepare(builtin, seq_len=seq_len)
        train = parquet_files(str(root / "train"), "data.builtin")
        val = parquet_files(str(root / "val"), "data.builtin")
    else:
        train = parquet_files(data["train"]["path"], "data.train.path")
        _check_columns(train, task, "data.train.path")
        val = None
        if data.get("val"):
            val = parquet_files(data["val"]["path"], "data.val.path")
            _check_columns(val, task, "data.val.path")
    cache = data.get("cache", "auto")
    if cache == "auto":
        remote = any(_is_remote(f) for f in train + (val or []))
        cache = not remote and _total_bytes(train + (val or [])) < CACHE_LIMIT_BYTES
    return DataPlan(train, val, task, cache=bool(cache), text=text)


def build_datasets(plan: DataPlan) -> dict[str, Any]:
    """Ray datasets for the trainer; small ones are cached in the object store.

    Caching matters: without it every epoch restarts Ray Data's executor and
    re-reads the files (1-2 s an epoch here, longer than an epoch of digits).
    """
    import ray.data  # lazy: about a second to import; `shoal validate` plans data without it

    context = ray.data.DataContext.get_current()
    context.print_on_execution_start = False
    context.execution_options.preserve_order = True  # the same row order in every run and attempt
    datasets = {"train": ray.data.read_parquet(plan.train)}
    if plan.val:
        datasets["val"] = ray.data.read_parquet(plan.val)
    if plan.cache:
        datasets = {name: ds.materialize() for name, ds in datasets.items()}
    return datasets
