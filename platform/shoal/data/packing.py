"""Token ids of documents -> windows of `seq_len + 1` tokens in parquet row groups.

Documents are laid end to end, each followed by the tokenizer's EOS id (empty
documents are skipped), and the stream is cut into consecutive windows of
`seq_len + 1` tokens: every token appears in exactly one window, in order. The
tokens after the last whole window (fewer than `seq_len + 1`) are dropped and
counted (`PackStats.dropped_tokens`).

A split is written as `part-00000.parquet`, ... with columns `id` (int64, the
window's index plus `first_id`) and `tokens` (fixed-size list of `seq_len + 1`
ids), in row groups of exactly `rows_per_group` rows (the last one may be
shorter), ROW_GROUPS_PER_FILE row groups a file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUPS_PER_FILE = 32


@dataclass
class PackStats:
    documents: int = 0  # non-empty documents packed
    tokens: int = 0  # tokens in windows, EOS included
    windows: int = 0  # rows written
    dropped_tokens: int = 0  # the tail after the last whole window
    files: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class WindowWriter:
    """Windows -> parquet files of row groups of exactly `rows_per_group` rows."""

    def __init__(self, directory: Path, window: int, rows_per_group: int, token_type: Any, first_id: int = 0):
        self.directory = Path(directory)
        self.window = window
        self.rows_per_group = rows_per_group
        self.token_type = np.dtype(token_type)
        self.next_id = first_id
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.files: list[Path] = []
        self.writer: pq.ParquetWriter | None = None
        self.groups_in_file = 0
        self.schema = pa.schema(
            [("id", pa.int64()), ("tokens", pa.list_(pa.from_numpy_dtype(self.token_type), window))]
        )

    def add(self, windows: np.ndarray) -> None:
        if len(windows):
            self.pending.append(windows.astype(self.token_type, copy=False))
            self.pending_rows += len(windows)
        while self.pending_rows >= self.rows_per_group:
            self._write_group(self.rows_per_group)

    def close(self) -> list[Path]:
        if self.pending_rows:
            self._write_group(self.pending_rows)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return self.files

    def _take(self, rows: int) -> np.ndarray:
        stacked = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        group, rest = stacked[:rows], stacked[rows:]
        self.pending = [rest] if len(rest) else []
        self.pending_rows = len(rest)
        return group

    def _write_group(self, rows: int) -> None:
        group = self._take(rows)
        ids = np.arange(self.next_id, self.next_id + rows, dtype=np.int64)
        self.next_id += rows
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(group.reshape(-1)), self.window)
        if self.writer is None or self.groups_in_file == ROW_GROUPS_PER_FILE:
            self._open_next_file()
        assert self.writer is not None
        self.writer.write_table(pa.table([pa.array(ids), tokens], schema=self.schema), row_group_size=rows)
        self.groups_in_file += 1

    def _open_next_file(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"part-{len(self.files):05d}.parquet"
        self.writer = pq.ParquetWriter(path, self.schema)
        self.files.append(path)
        self.groups_in_file = 0


class Packer:
    """Documents (arrays of ids) -> EOS-separated stream -> whole windows for a WindowWriter."""

    def __init__(self, eos_id: int, window: int, writer: WindowWriter):
        self.eos = np.array([eos_id], dtype=writer.token_type)
        self.window = window
        self.writer = writer
        self.carry = np.empty(0, dtype=writer.token_type)
        self.stats = PackStats()

    def add(self, documents: list[np.ndarray]) -> None:
        parts = [self.carry]
        for document in documents:
            if len(document):
                parts += [document, self.eos]
                self.stats.documents += 1
        if len(parts) == 1:
            return
        stream = np.concatenate(parts).astype(self.writer.token_type, copy=False)
        whole = len(stream) // self.window
        self.writer.add(stream[: whole * self.window].reshape(whole, self.window))
        self.stats.windows += whole
        self.carry = stream[whole * self.window :]

    def finish(self) -> PackStats:
        self.stats.dropped_tokens = len(self.carry)
        self.stats.tokens = self.stats.windows * self.window
        self.stats.files = len(self.writer.close())
        return self.stats
