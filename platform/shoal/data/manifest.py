"""A dataset's manifest: its parquet files and row groups, read from the footers only, sealed
with a digest.

The manifest is what a global epoch plan is computed from (global row ids, row groups as
the unit of reading) and what a checkpoint records to refuse resuming on other data.

The digest covers content facts only: each file's name relative to the dataset root (the
deepest directory holding every file), its size, and rows and compressed bytes per row
group. It leaves out the root and modification times, so the same files copied to another
folder or bucket keep their digest, while adding, removing, renaming or rewriting a file
changes it. Names stay in because the file order (sorted by name) fixes the global row ids.

Building reads one footer per file; `load_or_build_manifest` caches the result as JSON,
keyed by the files' paths, sizes and modification times, so a relaunch only lists the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from shoal.data.errors import DataError

FORMAT = 1  # of the digested content and the cached JSON; bump when either changes
ACCEPT_SETTING = "data.accept_changed_data"
GROUPS_PER_LANE = 20  # row groups to each lane of the epoch plan (see coarse_row_groups)


@dataclass(frozen=True)
class ManifestFile:
    path: str  # as given: a local path or a URI
    size: int  # bytes
    stamp: str  # modification time in ns as the store reports it ("" if none); the cache key only


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into Manifest.files
    index: int  # row group within its file
    rows: int
    bytes: int  # compressed, summed over the column chunks in the footer
    first_row: int  # global row id of the group's first row


@dataclass(frozen=True)
class Manifest:
    files: tuple[ManifestFile, ...]  # sorted by path (build_manifest), which fixes the global row ids
    row_groups: tuple[RowGroup, ...]  # file by file, in file order
    total_rows: int
    total_bytes: int
    digest: str  # sha256 hex, see the module docstring

    @classmethod
    def from_groups(
        cls, files: Sequence[ManifestFile], groups: Sequence[Sequence[tuple[int, int]]]
    ) -> Manifest:
        """The manifest of `files`, in this order, whose row groups are `groups[i]`: (rows, bytes)
        per row group of file i. Also how tests make manifests without parquet files."""
        if len(files) != len(groups):
            raise ValueError(f"{len(files)} files but row groups for {len(groups)}")
        row_groups, next_row = [], 0
        for file, file_groups in enumerate(groups):
            for index, (rows, size) in enumerate(file_groups):
                row_groups.append(RowGroup(file, index, rows, size, next_row))
                next_row += rows
        total_bytes = sum(g.bytes for g in row_groups)
        return cls(tuple(files), tuple(row_groups), next_row, total_bytes, content_digest(files, groups))

    @property
    def root(self) -> str:
        return dataset_root([f.path for f in self.files])

    def groups_of(self, file: int) -> list[tuple[int, int]]:
        return self._groups_per_file()[file]

    def _groups_per_file(self) -> list[list[tuple[int, int]]]:
        """(rows, bytes) of each file's row groups, in one pass over them."""
        per_file: list[list[tuple[int, int]]] = [[] for _ in self.files]
        for g in self.row_groups:
            per_file[g.file].append((g.rows, g.bytes))
        return per_file

    def to_json(self) -> str:
        files = [
            {"path": f.path, "size": f.size, "stamp": f.stamp, "row_groups": groups}
            for f, groups in zip(self.files, self._groups_per_file(), strict=True)
        ]
        return json.dumps({"format": FORMAT, "digest": self.digest, "files": files}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """The manifest `to_json` wrote; ValueError when the text is not one or its digest does
        not match its content."""
        try:
            data = json.loads(text)
            if data["format"] != FORMAT:
                raise ValueError(f"manifest format {data['format']}, expected {FORMAT}")
            files = [ManifestFile(str(f["path"]), int(f["size"]), str(f["stamp"])) for f in data["files"]]
            groups = [[(int(rows), int(size)) for rows, size in f["row_groups"]] for f in data["files"]]
            recorded = data["digest"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a manifest: {exc!r}") from None
        manifest = cls.from_groups(files, groups)
        if manifest.digest != recorded:
            raise ValueError("the manifest's digest does not match its content")
        return manifest


def dataset_root(paths: Sequence[str]) -> str:
    """The deepest directory holding every path, with its trailing '/' ('' for bare names).
    Plain string work, so URIs ('s3://bucket/dir/') keep their scheme."""
    parents = [p.split("/")[:-1] for p in paths]
    common = os.path.commonprefix(parents) if parents else []
    return "/".join(common) + "/" if common else ""


def content_digest(files: Sequence[ManifestFile], groups: Sequence[Sequence[tuple[int, int]]]) -> str:
    root = dataset_root([f.path for f in files])
    content = [
        [f.path.removeprefix(root), f.size, [list(g) for g in file_groups]]
        for f, file_groups in zip(files, groups, strict=True)
    ]
    canonical = json.dumps({"format": FORMAT, "files": content}, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def build_manifest(files: list[str], filesystem: pafs.FileSystem | None = None) -> Manifest:
    """The manifest of parquet `files`, from their footers (no column data is read).

    `filesystem` is a pyarrow filesystem the paths are in; without one, local paths are read
    locally and URIs through the filesystem pyarrow infers from the first one. A file that is
    missing or has no readable footer is a DataError naming it.
    """
    fs, located = locate_files(files, filesystem)
    listed = _list_files(fs, located)
    return _from_footers(fs, located, listed)


def load_or_build_manifest(
    files: list[str], cache_dir: str | Path, filesystem: pafs.FileSystem | None = None
) -> Manifest:
    """`build_manifest`, but from `cache_dir` when these paths, with these sizes and modification
    times, were built before. A cache file that cannot be read back is rebuilt and replaced."""
    fs, located = locate_files(files, filesystem)
    listed = _list_files(fs, located)
    cache_file = Path(cache_dir) / f"manifest-{_cache_key(listed)[:32]}.json"
    cached = _read_cached(cache_file, listed)
    if cached is not None:
        return cached
    manifest = _from_footers(fs, located, listed)
    _write_atomically(cache_file, manifest.to_json())
    return manifest


def check_resume(
    recorded_digest: str, current_digest: str, accept_changed: bool, *, where: str = "data.train.path"
) -> None:
    """Refuse to resume when the checkpoint recorded another digest than the data's now, unless
    the user accepted changed data; `where` names the setting the data came from."""
    if recorded_digest == current_digest or accept_changed:
        return
    raise DataChangedError(
        where,
        f"the data changed since the checkpoint was written: its manifest digest is "
        f"{current_digest[:12]}, the checkpoint recorded {recorded_digest[:12]}; to resume on the "
        f"changed data deliberately, set {ACCEPT_SETTING}: true",
    )


class DataChangedError(DataError):
    """Resuming on data whose manifest digest differs from the one the checkpoint recorded."""


def coarse_row_groups(
    manifest: Manifest, micro_batch_rows: int, global_batch: int, window_rows: int
) -> str | None:
    """A one-line warning when the row groups are too coarse for the epoch plan
    (data/epoch_plan.py) of this global batch; None when they are fine.

    A rank reads whole row groups, so row groups are the grain of everything a rank does.
    The rule has two parts:
    - reading: the plan cuts the data into global_batch / micro lanes, and a rank reads its
      lanes' row groups plus at most one at each end of a lane. With fewer than
      GROUPS_PER_LANE (20) row groups to a lane, those ends are more than 10 % of its reading;
    - mixing: a row group of more than half a shuffle window (`data.shuffle_buffer`) leaves
      the window little else to mix its rows with.
    An empty dataset, or one without a whole global batch, gets None: that is for the checks
    that refuse it.
    """
    sizes = [g.rows for g in manifest.row_groups if g.rows]
    lanes = global_batch // micro_batch_rows
    lane_rows = manifest.total_rows // global_batch * micro_batch_rows
    if not sizes or not lane_rows:
        return None
    median = statistics.median_low(sizes)
    most = lane_rows // GROUPS_PER_LANE
    if window_rows:
        most = min(most, max(1, window_rows // 2))
    if median <= most:
        return None
    return (
        f"the data's row groups are too coarse for global batches of {global_batch} rows "
        f"({lanes} lane(s) of {lane_rows} rows): median {median} rows per row group (want <= {most}, "
        f"so that a worker reads at most 10 % beyond its share and each shuffle window mixes rows "
        f"of several row groups); rewrite it with shoal data pack SRC DST --rows-per-group {most}"
    )


def locate_files(
    files: list[str], filesystem: pafs.FileSystem | None = None
) -> tuple[pafs.FileSystem, dict[str, str]]:
    """The filesystem and, per given path, the path within it (the manifest's and the reader's)."""
    if not files:
        raise ValueError("a manifest needs at least one file")
    remote = ["://" in f for f in files]
    if filesystem is None and any(remote) and not all(remote):
        raise DataError(files[remote.index(False)], "local files mixed with URIs in one dataset")
    if filesystem is None and remote[0]:
        # One filesystem for all files: inferring it per file would re-resolve the store each time.
        filesystem, _ = pafs.FileSystem.from_uri(files[0])
    elif filesystem is None:
        filesystem = pafs.LocalFileSystem()
    given_as: dict[str, str] = {}  # path within the filesystem -> as given
    for file in files:
        within = _path_within(file)
        if within in given_as:
            raise DataError(file, f"listed twice in one dataset (also as '{given_as[within]}')")
        given_as[within] = file
    return filesystem, {given: within for within, given in given_as.items()}


def _path_within(path: str) -> str:
    if "://" in path:
        return path.split("://", 1)[1]  # s3://bucket/key -> bucket/key; file:///a -> /a
    return os.path.abspath(path)


def _list_files(fs: pafs.FileSystem, located: dict[str, str]) -> list[ManifestFile]:
    """Each file's size and modification time, sorted by path; a DataError for one that is
    missing or not a file."""
    paths = sorted(located)
    listed = []
    for path, info in zip(paths, fs.get_file_info([located[p] for p in paths]), strict=True):
        if info.type == pafs.FileType.NotFound:
            raise DataError(path, "no such file")
        if info.type != pafs.FileType.File:
            raise DataError(path, "not a file")
        listed.append(ManifestFile(path, info.size, "" if info.mtime_ns is None else str(info.mtime_ns)))
    return listed


def _from_footers(fs: pafs.FileSystem, located: dict[str, str], listed: list[ManifestFile]) -> Manifest:
    return Manifest.from_groups(listed, [_footer_groups(fs, located[f.path], f.path) for f in listed])


def _footer_groups(fs: pafs.FileSystem, located: str, given: str) -> list[tuple[int, int]]:
    try:
        metadata = pq.read_metadata(located, filesystem=fs)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(given, f"cannot read the parquet footer: {exc}") from None
    groups = []
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        size = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        groups.append((group.num_rows, size))
    return groups


def _cache_key(listed: list[ManifestFile]) -> str:
    facts = [[f.path, f.size, f.stamp] for f in listed]
    return hashlib.sha256(json.dumps([FORMAT, facts]).encode()).hexdigest()


def _read_cached(cache_file: Path, listed: list[ManifestFile]) -> Manifest | None:
    """The cached manifest of exactly these files, or None (none yet, unreadable, or stale)."""
    try:
        manifest = Manifest.from_json(cache_file.read_text())
    except (OSError, ValueError):  # json.JSONDecodeError is a ValueError
        return None
    return manifest if list(manifest.files) == listed else None


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file renamed over `path`: a killed process leaves the old file
    or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
