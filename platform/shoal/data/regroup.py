"""`shoal data pack SRC DST --rows-per-group N`: a user's parquet rewritten into row groups
small enough for the epoch plan (data/epoch_plan.py), by Ray Data.

Rows keep their order (Ray Data's `preserve_order`) and their columns; only the cut into
files and row groups changes. DST must not hold anything yet: nothing already written is
overwritten.
"""

from __future__ import annotations

from pathlib import Path

from shoal.data.errors import DataError
from shoal.data.manifest import Manifest, build_manifest
from shoal.data.sources import parquet_files


def check_target(dst: str) -> None:
    """DST: a local directory that does not exist or is empty, or an object-store prefix."""
    if "://" in dst and not dst.startswith("file://"):
        return
    target = Path(dst.removeprefix("file://"))
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise DataError("DST", f"'{dst}' already holds files; give a new or empty directory")


def regroup_parquet(src: str, dst: str, rows_per_group: int, *, show_progress: bool = True) -> Manifest:
    """Rewrite SRC's parquet into DST with row groups of `rows_per_group` rows (the last of each
    file may be shorter); returns DST's manifest. Needs Ray initialised (the caller's)."""
    if rows_per_group < 1:
        raise DataError("--rows-per-group", f"must be >= 1 (got {rows_per_group})")
    files = parquet_files(src, "SRC")
    check_target(dst)
    import ray.data  # lazy: about a second to import; the rest of `shoal data` runs without it

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = show_progress
    context.print_on_execution_start = False
    ray.data.read_parquet(files).write_parquet(dst, row_group_size=rows_per_group)
    return build_manifest(parquet_files(dst, "DST"))
