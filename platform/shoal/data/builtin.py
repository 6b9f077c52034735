"""Built-in corpora, prepared deterministically from a seed into parquet shards.

Layout of a prepared corpus directory:
    train/part-00000.parquet ...   val/part-00000.parquet ...   manifest.json
`manifest.json` is written last, into a temporary directory that is then
renamed into place, so a half-prepared corpus is never mistaken for a ready one.

- digits: scikit-learn's bundled 8x8 handwritten digits (1,797 images), columns
  `id` (int64), `x` (64 float32 in [0, 1]), `y` (int64 label 0-9).
- pytext: bytes of the running interpreter's standard-library .py sources cut
  into windows of `seq_len + 1` tokens, columns `id` (int64), `tokens`
  (uint8 list); train and val are split by source file.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: row groups small enough for the epoch plan's lanes
ROWS_PER_SHARD = {"digits": 400, "pytext": 16384}
# Row groups are what a worker reads (data/epoch_plan.py): a twentieth of a lane or less at
# the global batches these corpora are used with (digits: 2 lanes of 704 rows at 128 / 64).
ROWS_PER_GROUP = {"digits": 32, "pytext": 512}
BUILTINS = ("digits", "pytext")


def cache_root() -> Path:
    return Path(os.environ.get("SHOAL_DATA_CACHE", Path.home() / ".cache" / "shoal" / "data"))


def cache_dir(name: str, seq_len: int | None = None) -> Path:
    return cache_root() / (f"pytext-seq{seq_len}" if name == "pytext" else name)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _write_shards(table: pa.Table, directory: Path, rows_per_shard: int, rows_per_group: int) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    shards = max(1, -(-table.num_rows // rows_per_shard))
    for index in range(shards):
        chunk = table.slice(index * rows_per_shard, rows_per_shard)
        pq.write_table(chunk, directory / f"part-{index:05d}.parquet", row_group_size=rows_per_group)
    return shards


def _digits_tables(seed: int, val_fraction: float = 0.2) -> tuple[pa.Table, pa.Table, dict]:
    from sklearn.datasets import load_digits  # lazy: over 2 s to import, needed once per cache

    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = int(round(len(labels) * val_fraction))

    def table(indices: np.ndarray) -> pa.Table:
        flat = pa.array(images[indices].reshape(-1))
        return pa.table(
            {
                "id": pa.array(indices.astype(np.int64)),
                "x": pa.FixedSizeListArray.from_arrays(flat, images.shape[1]),
                "y": pa.array(labels[indices]),
            }
        )

    return table(order[n_val:]), table(order[:n_val]), {"num_classes": 10, "features": 64}


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def _windows(files: list[Path], window: int) -> np.ndarray:
    stream = b"\n\n".join(f.read_bytes() for f in files)
    tokens = np.frombuffer(stream, dtype=np.uint8)
    count = len(tokens) // window
    return tokens[: count * window].reshape(count, window)


def _pytext_tables(seed: int, seq_len: int, val_fraction: float = 0.05) -> tuple[pa.Table, pa.Table, dict]:
    files = stdlib_sources()
    root = Path(sysconfig.get_paths()["stdlib"])
    # Split by file (not by window) so that val text is never seen in training.
    is_val = [
        zlib.crc32(f"{seed}:{f.relative_to(root)}".encode()) % 10_000 < val_fraction * 10_000 for f in files
    ]
    rng = np.random.default_rng(seed)
    train_files = [f for f, v in zip(files, is_val, strict=True) if not v]
    val_files = [f for f, v in zip(files, is_val, strict=True) if v]
    rng.shuffle(train_files)

    def table(windows: np.ndarray, first_id: int) -> pa.Table:
        windows = windows[rng.permutation(len(windows))]
        flat = pa.array(windows.reshape(-1))
        return pa.table(
            {
                "id": pa.array(np.arange(first_id, first_id + len(windows), dtype=np.int64)),
                "tokens": pa.FixedSizeListArray.from_arrays(flat, windows.shape[1]),
            }
        )

    train = table(_windows(train_files, seq_len + 1), 0)
    val = table(_windows(val_files, seq_len + 1), train.num_rows)
    info = {
        "seq_len": seq_len,
        "vocab_size": 256,
        "files": {"train": len(train_files), "val": len(val_files)},
    }
    return train, val, info


def prepare(
    name: str,
    directory: str | Path | None = None,
    *,
    seed: int = 0,
    seq_len: int = 256,
    force: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> Path:
    """Prepare a built-in corpus (idempotent); returns its directory."""
    if name not in BUILTINS:
        raise ValueError(f"unknown built-in corpus '{name}' (available: {', '.join(BUILTINS)})")
    target = Path(directory) if directory is not None else cache_dir(name, seq_len)
    wanted = {"name": name, "seed": seed, "format": FORMAT_VERSION}
    if name == "pytext":
        wanted["seq_len"] = seq_len
    existing = read_manifest(target)
    if existing and not force and all(existing.get(k) == v for k, v in wanted.items()):
        return target
    if target.exists() and any(target.iterdir()) and existing is None:
        raise FileExistsError(f"{target} exists and is not a prepared shoal corpus; choose another directory")
    if on_progress:
        on_progress(f"preparing built-in corpus '{name}' in {target}")
    if name == "digits":
        train, val, info = _digits_tables(seed)
    else:
        train, val, info = _pytext_tables(seed, seq_len)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        shards = {
            "train": _write_shards(train, staging / "train", ROWS_PER_SHARD[name], ROWS_PER_GROUP[name]),
            "val": _write_shards(val, staging / "val", ROWS_PER_SHARD[name], ROWS_PER_GROUP[name]),
        }
        manifest = {
            **wanted,
            **info,
            "rows": {"train": train.num_rows, "val": val.num_rows},
            "shards": shards,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:  # another process finished first with the same corpus
            if read_manifest(target) is None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
