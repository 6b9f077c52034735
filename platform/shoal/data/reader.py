"""Reading a manifest's row groups, whole, and counting what crosses the wire.

A rank reads only the row groups its lanes need (data/epoch_plan.py), straight from the
parquet files with pyarrow (local disk or object storage): the footer once per file it
opens, then one row group at a time. Every byte read goes through `CountingFile`, so
`bytes_read` is what the store served this rank, footers included, not an estimate.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from shoal.data.errors import DataError
from shoal.data.manifest import Manifest, locate_files

OPEN_FILES = 16  # parquet files a reader keeps open (footers parsed) at once


@dataclass
class ReadCounts:
    """What one rank read, decoded and trained in one epoch."""

    bytes_read: int = 0
    rows_decoded: int = 0
    rows_trained: int = 0

    def take(self) -> ReadCounts:
        """These counts, and zero them for the next epoch."""
        taken = ReadCounts(self.bytes_read, self.rows_decoded, self.rows_trained)
        self.bytes_read = self.rows_decoded = self.rows_trained = 0
        return taken


class CountingFile:
    """A read-only file object over a pyarrow input file that adds up the bytes read."""

    def __init__(self, raw: pa.NativeFile, counts: ReadCounts):
        self.raw, self.counts, self.closed = raw, counts, False

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size if size is not None and size >= 0 else None)
        self.counts.bytes_read += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def size(self) -> int:
        return self.raw.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.raw.close()
        self.closed = True


class RowGroupReader:
    """Whole row groups of a manifest's files, by the manifest's group index."""

    def __init__(self, manifest: Manifest, counts: ReadCounts, filesystem: pafs.FileSystem | None = None):
        self.manifest, self.counts = manifest, counts
        given = [f.path for f in manifest.files]
        self.filesystem, located = locate_files(given, filesystem)
        self.paths = [located[path] for path in given]
        self.open: OrderedDict[int, tuple[CountingFile, pq.ParquetFile]] = OrderedDict()

    def read(self, group: int) -> pa.Table:
        row_group = self.manifest.row_groups[group]
        parquet = self._file(row_group.file)
        try:
            table = parquet.read_row_group(row_group.index)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(
                self.manifest.files[row_group.file].path, f"cannot read row group {row_group.index}: {exc}"
            ) from None
        if table.num_rows != row_group.rows:
            raise DataError(
                self.manifest.files[row_group.file].path,
                f"row group {row_group.index} has {table.num_rows} rows, the manifest says {row_group.rows}: "
                "the file changed after the manifest was built",
            )
        self.counts.rows_decoded += table.num_rows
        return table

    def _file(self, index: int) -> pq.ParquetFile:
        if index in self.open:
            self.open.move_to_end(index)
            return self.open[index][1]
        if len(self.open) >= OPEN_FILES:
            _, (stale, _) = self.open.popitem(last=False)
            stale.close()
        try:
            raw = CountingFile(self.filesystem.open_input_file(self.paths[index]), self.counts)
            parquet = pq.ParquetFile(raw, metadata=read_footer(raw))
        except (OSError, pa.ArrowException, ValueError) as exc:
            raise DataError(self.manifest.files[index].path, f"cannot open: {exc}") from None
        self.open[index] = (raw, parquet)
        return parquet

    def close(self) -> None:
        for raw, _ in self.open.values():
            raw.close()
        self.open.clear()


def read_footer(file: CountingFile) -> pq.FileMetaData:
    """A parquet file's metadata, reading the footer's own bytes only (pyarrow on its own reads
    the last 64 KiB of every file it opens: more than a small file's row groups)."""
    size = file.size()
    file.seek(size - 8)
    tail = file.read(8)
    if len(tail) != 8 or tail[4:] != b"PAR1":
        raise ValueError("not a parquet file (no PAR1 at its end)")
    length = struct.unpack("<i", tail[:4])[0]
    if not 0 < length <= size - 12:
        raise ValueError(f"a parquet footer of {length} bytes in a file of {size}")
    file.seek(size - 8 - length)
    footer = file.read(length) + tail
    return pq.read_metadata(pa.BufferReader(footer))


def to_tensors(table: pa.Table) -> dict[str, torch.Tensor]:
    """A batch of rows as tensors: numbers as they are, equal-length lists of numbers as one
    more dimension each (columns of any other type are left out)."""
    return Rows.of(table).tensors


class Rows:
    """Rows whose numeric columns are tensors, converted once (a window of a lane, on the
    loader thread: converting each micro-batch of a small model cost ~0.4 ms of its step),
    and a micro-batch of them as tensors (`take`). A column of number lists whose lengths
    differ is kept as it is: the rows of a micro-batch may still agree."""

    def __init__(self, tensors: dict[str, torch.Tensor], ragged: pa.Table, count: int):
        self.tensors, self.ragged, self.count = tensors, ragged, count

    @staticmethod
    def of(table: pa.Table) -> Rows:
        tensors, ragged = {}, []
        for name, column in zip(table.column_names, table.columns, strict=True):
            array = _numeric_array(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0))
            if array is not None:
                tensors[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
            elif _list_of_numbers(column.type):
                ragged.append(name)
        return Rows(tensors, table.select(ragged), table.num_rows)

    def take(self, start: int, length: int) -> dict[str, torch.Tensor]:
        """Rows start..start+length as tensors (views of the converted columns)."""
        batch = {name: tensor[start : start + length] for name, tensor in self.tensors.items()}
        if self.ragged.num_columns:
            batch.update(Rows.of(self.ragged.slice(start, length)).tensors)
        return batch


def _list_of_numbers(kind: pa.DataType) -> bool:
    if not _is_list(kind):
        return False
    while _is_list(kind):
        kind = kind.value_type
    return _is_number(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _numeric_array(array: pa.Array) -> np.ndarray | None:
    shape = [len(array)]
    while _is_list(array.type):
        lengths = array.value_lengths().to_numpy(zero_copy_only=False) if len(array) else np.zeros(0)
        if len(lengths) and (lengths != lengths[0]).any():
            return None  # ragged: not a tensor
        shape.append(int(lengths[0]) if len(lengths) else 0)
        array = array.flatten()
    if not _is_number(array.type):
        return None
    return np.ascontiguousarray(array.to_numpy(zero_copy_only=False)).reshape(shape)
