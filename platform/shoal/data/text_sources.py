"""Raw text files: which ones a path names, their format, and their documents in order.

Formats, by extension: `.jsonl` / `.json` (JSON lines, one document per line, the
text in field `data.text_column`), `.parquet` (one document per row of column
`data.text_column`), `.txt` (one document per file, UTF-8). A directory means the
files under it with one of these extensions, in sorted order.

Documents are read in file order, then row order, in batches: in this process for
small inputs, with Ray Data for large ones (`read_parquet`, or `read_binary_files`
and `map_batches` to split jsonl and txt files into documents; `map_batches` to
tokenize). Reads run on this machine's node (the files are here); errors of Ray
tasks travel as data (column PROBLEM).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from shoal.data.errors import DataError
from shoal.data.tokenizers import TextTokenizer

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "txt"}
BATCH_DOCUMENTS = 1024
RAY_MIN_BYTES = 32 * 1024**2  # below this, starting Ray costs more than tokenizing in-process
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id under this label
RAY_QUIET = {"RAY_DATA_DISABLE_PROGRESS_BARS": "1", "RAY_DATA_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class TextFiles:
    """The files of one split, all of one format."""

    files: tuple[str, ...]
    format: str  # jsonl | parquet | txt
    column: str  # the text field (jsonl, parquet)
    where: str  # the setting that named them, for errors

    def fingerprint(self) -> list[tuple[str, int, int]]:
        """(path, size, mtime) of each file: what the cache key hashes."""
        stats = [(f, os.stat(f)) for f in self.files]
        return [(f, s.st_size, s.st_mtime_ns) for f, s in stats]

    def total_bytes(self) -> int:
        return sum(os.stat(f).st_size for f in self.files)

    def count_documents(self) -> int:
        """Documents to read (for progress; jsonl: lines, counted without parsing)."""
        if self.format == "txt":
            return len(self.files)
        if self.format == "parquet":
            return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        return sum(_count_lines(f) for f in self.files)


def _count_lines(path: str) -> int:
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


def _files_at(path: str, where: str) -> list[str]:
    local = path.removeprefix("file://")
    if any(ch in local for ch in "*?["):
        files = sorted(glob.glob(local, recursive=True))
    elif Path(local).is_dir():
        files = sorted(str(p) for p in Path(local).rglob("*") if p.suffix in FORMATS and p.is_file())
    elif Path(local).is_file():
        files = [local]
    else:
        raise DataError(where, f"no such file or directory: '{path}'")
    if not files:
        raise DataError(where, f"no parquet files found at '{path}' (nor text: .jsonl, .json, .txt)")
    return [str(Path(f).resolve()) for f in files]


def text_format(path: str, where: str) -> str | None:
    """jsonl | txt | parquet for what `path` names; None for object-store parquet (not read here)."""
    if "://" in path and not path.startswith("file://"):
        suffix = Path(path.rstrip("/")).suffix
        if FORMATS.get(suffix, "parquet") != "parquet":
            raise DataError(where, f"raw text must be local files; '{path}' is remote (pack it, then upload)")
        return None
    formats = {FORMATS.get(Path(f).suffix) for f in _files_at(path, where)}
    if None in formats or len(formats) > 1:
        names = sorted(f or "other" for f in formats)
        raise DataError(
            where, f"'{path}' mixes formats ({', '.join(names)}); one of {', '.join(FORMATS)} only"
        )
    return formats.pop()


def text_files(path: str, where: str, column: str) -> TextFiles:
    files = tuple(_files_at(path, where))
    source = TextFiles(files, FORMATS[Path(files[0]).suffix], column, where)
    if source.format == "parquet":
        _check_text_column(source)
    return source


def parquet_text_column(path: str, column: str) -> bool | None:
    """For parquet: None when its first file holds `tokens` (token data); else whether it has a
    string column `column`."""
    schema = pq.read_schema(_files_at(path, "")[0])
    if "tokens" in schema.names:
        return None
    return column in schema.names and _is_string(schema.field(column).type)


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _check_text_column(source: TextFiles) -> None:
    for file in source.files:
        try:
            schema = pq.read_schema(file)
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise DataError(source.where, f"cannot read parquet file '{file}': {exc}") from None
        if source.column not in schema.names:
            raise DataError(
                "data.text_column",
                f"'{file}' has no column '{source.column}' (has {sorted(schema.names)})",
            )
        if not _is_string(schema.field(source.column).type):
            kind = schema.field(source.column).type
            raise DataError("data.text_column", f"column '{source.column}' of '{file}' is {kind}, not text")


def _json_options(column: str) -> pajson.ParseOptions:
    return pajson.ParseOptions(
        explicit_schema=pa.schema([(column, pa.string())]), unexpected_field_behavior="ignore"
    )


def texts_of(values: pa.Array | pa.ChunkedArray, source: TextFiles, file: str) -> list[str]:
    """A column of documents as strings; a missing text is an error naming the file."""
    if not _is_string(values.type) and not pa.types.is_null(values.type):
        raise DataError(
            "data.text_column", f"field '{source.column}' of '{file}' holds {values.type}, not text"
        )
    if values.null_count:
        raise DataError(
            "data.text_column",
            f"{values.null_count} document(s) of '{file}' have no string field '{source.column}'",
        )
    return values.to_pylist()


def _decode(data: bytes, file: str, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(where, f"'{file}' is not UTF-8 text: {exc}") from None


def _texts_in(data: bytes, file: str, source: TextFiles) -> list[str]:
    """The documents of one jsonl or txt file's bytes."""
    if source.format == "txt":
        return [_decode(data, file, source.where)]
    try:
        table = pajson.read_json(pa.BufferReader(data), parse_options=_json_options(source.column))
    except pa.ArrowInvalid as exc:
        message = str(exc).splitlines()[0]
        raise DataError(
            source.where, f"'{file}' is not JSON lines with a text '{source.column}': {message}"
        ) from None
    return texts_of(table.column(0), source, file)


def _local_file_texts(source: TextFiles, file: str) -> Iterator[list[str]]:
    if source.format == "parquet":
        for batch in pq.ParquetFile(file).iter_batches(BATCH_DOCUMENTS, columns=[source.column]):
            yield texts_of(batch.column(0), source, file)
        return
    texts = _texts_in(Path(file).read_bytes(), file, source)
    for start in range(0, len(texts), BATCH_DOCUMENTS):
        yield texts[start : start + BATCH_DOCUMENTS]


def local_texts(source: TextFiles) -> Iterator[list[str]]:
    """Documents in batches, read in this process."""
    for file in source.files:
        yield from _local_file_texts(source, file)


def use_ray(sources: list[TextFiles], engine: str) -> bool:
    """Ray Data for `engine` "ray", or "auto" with RAY_MIN_BYTES of input or more."""
    if engine != "auto":
        return engine == "ray"
    return sum(s.total_bytes() for s in sources) >= RAY_MIN_BYTES


class RayWhenNeeded:
    """The Ray of this process, or a local one started on first need and stopped at exit."""

    def __init__(self, wanted: bool):
        self.wanted = wanted
        self.started = False

    def __enter__(self) -> RayWhenNeeded:
        return self

    def ensure(self) -> None:
        if not self.wanted:
            return
        # deferred: Ray loads only when text is read with Ray Data
        import ray

        if ray.is_initialized():
            return
        for key, value in RAY_QUIET.items():
            os.environ.setdefault(key, value)
        ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        self.started = True

    def __exit__(self, *exc: object) -> None:
        if self.started:
            # deferred: Ray loads only when text is read with Ray Data
            import ray

            ray.shutdown()


def _ray_dataset(source: TextFiles) -> Any:
    """Ray Data rows {text, path} of a split, in file and row order."""
    # deferred: Ray loads only when text is packed with Ray Data
    import ray
    import ray.data

    # The files are on this machine: read them here, whichever cluster this process is part of.
    here = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
    options = {"include_paths": True, "label_selector": here}
    paths = list(source.files)
    if source.format == "parquet":
        return ray.data.read_parquet(paths, columns=[source.column], **options)
    # jsonl too: parsed by the same code as in-process, so that a bad file gives the same error
    raw = ray.data.read_binary_files(paths, **options)
    return raw.map_batches(_texts_batch, fn_kwargs={"source": source}, batch_format="pyarrow")


PROBLEM = "problem"  # a DataError of a Ray task, as data: Ray does not carry the exception's type


def _problem(error: DataError) -> str:
    return f"{error.path}\t{error.message}"


def _raise_problem(batch: pa.Table) -> None:
    if PROBLEM in batch.column_names and batch.column(PROBLEM).null_count < batch.num_rows:
        found = next(p for p in batch.column(PROBLEM).to_pylist() if p)
        path, message = found.split("\t", 1)
        raise DataError(path, message)


def _texts_batch(batch: pa.Table, source: TextFiles) -> pa.Table:
    """Whole jsonl or txt files -> one row per document, {text, path, problem}."""
    texts: list[str] = []
    paths: list[str] = []
    problems: list[str | None] = []
    for data, path in zip(batch.column("bytes").to_pylist(), batch.column("path").to_pylist(), strict=True):
        try:
            found, problem = _texts_in(data, path, source), None
        except DataError as error:
            found, problem = [""], _problem(error)
        texts += found
        paths += [path] * len(found)
        problems += [problem] * len(found)
    return pa.table({"text": texts, "path": paths, PROBLEM: pa.array(problems, pa.string())})


def _text_column(source: TextFiles) -> str:
    return source.column if source.format == "parquet" else "text"


def _tokenize_batch(batch: pa.Table, tokenizer: TextTokenizer, source: TextFiles) -> pa.Table:
    column = _text_column(source)
    try:
        _raise_problem(batch)
        file = batch.column("path")[0].as_py() if batch.num_rows else ""
        ids = tokenizer.encode_batch(texts_of(batch.column(column), source, file))
        problems = pa.nulls(len(ids), pa.string())
    except DataError as error:
        ids = [np.empty(0, dtype=np.int32)] * batch.num_rows
        problems = pa.array([_problem(error)] * batch.num_rows, pa.string())
    lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(ids) if ids else np.empty(0, dtype=np.int32)
    ids_column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pa.table({"ids": ids_column, PROBLEM: problems})


def _first_error_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if ("Error: " in line or "Invalid: " in line) and "UserCode" not in line]
    return (named or lines or [type(exc).__name__])[-1][:300]


@contextmanager
def _ray_errors(source: TextFiles) -> Iterator[None]:
    """A failed Ray Data read as a DataError naming the files' setting."""
    # deferred: Ray loads only when text is packed with Ray Data
    from ray.exceptions import RayError

    try:
        yield
    except RayError as exc:
        raise DataError(
            source.where, f"cannot read the {source.format} files: {_first_error_line(exc)}"
        ) from None


@contextmanager
def _ordered() -> Iterator[None]:
    # deferred: Ray loads only when text is packed with Ray Data
    from ray.data import DataContext

    context = DataContext.get_current()
    before = (context.execution_options.preserve_order, context.print_on_execution_start)
    context.execution_options.preserve_order = True  # the same windows in the same order, every time
    context.print_on_execution_start = False
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.print_on_execution_start = before


def ray_texts(source: TextFiles) -> Iterator[list[str]]:
    """Documents in batches, read by Ray Data (train_bpe learns from these)."""
    column = _text_column(source)
    with _ordered(), _ray_errors(source):
        for batch in _ray_dataset(source).iter_batches(batch_format="pyarrow", batch_size=BATCH_DOCUMENTS):
            _raise_problem(batch)
            yield texts_of(batch.column(column), source, batch.column("path")[0].as_py())


def ray_token_batches(source: TextFiles, tokenizer: TextTokenizer) -> Iterator[list[np.ndarray]]:
    """Token ids per document, tokenized by Ray Data's map_batches, in document order."""
    dataset = _ray_dataset(source).map_batches(
        _tokenize_batch,
        fn_kwargs={"tokenizer": tokenizer, "source": source},
        batch_format="pyarrow",
        batch_size=BATCH_DOCUMENTS,
    )
    with _ordered(), _ray_errors(source):
        for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            _raise_problem(batch)
            ids = batch.column("ids").combine_chunks()
            offsets = ids.offsets.to_numpy()
            values = ids.values.to_numpy(zero_copy_only=False)
            yield [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def token_batches(
    source: TextFiles, tokenizer: TextTokenizer, with_ray: bool, advance: Callable[[int], None]
) -> Iterator[list[np.ndarray]]:
    """Token ids per document, in order; `advance(n)` after each batch of n documents."""
    if with_ray:
        batches = ray_token_batches(source, tokenizer)
    else:
        batches = (tokenizer.encode_batch(texts) for texts in local_texts(source))
    for batch in batches:
        yield batch
        advance(len(batch))


def document_batches(source: TextFiles, with_ray: bool) -> Iterator[list[str]]:
    return ray_texts(source) if with_ray else local_texts(source)
