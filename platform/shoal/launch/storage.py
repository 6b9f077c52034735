"""Where a run's checkpoints live: a local directory or object storage (s3://bucket/prefix).

Ray Train writes checkpoints through the pyarrow filesystem given here; the driver
uses the same one to look for a run's checkpoints and to keep its best one.
Logs, worker pid files and sample audits always go to a local run directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow.fs as pafs

from shoal.errors import ShoalError
from shoal.redact import redact
from shoal.worker.checkpoint.format import TRAINER_STATE, checkpoint_steps

LOCAL_RUNS = "./shoal_runs"
# Ray Train 2.60's record of a run's checkpoints, rewritten in place at each one: a disk that
# fills while it is written leaves it cut short, and Ray's controller then cannot start.
RAY_CHECKPOINT_RECORD = "checkpoint_manager_snapshot.json"


class StorageError(ShoalError):
    """Checkpoint storage that cannot be used; the message names it."""


@dataclass
class Storage:
    uri: str  # as shown to people: an absolute directory or s3://bucket/prefix
    path: str  # the root as the filesystem names it (no scheme)
    filesystem: pafs.FileSystem
    remote: bool

    def run_path(self, run_name: str) -> str:
        return f"{self.path}/{run_name}"

    def run_uri(self, run_name: str) -> str:
        return f"{self.uri}/{run_name}"

    def local_run_dir(self, run_name: str) -> Path:
        """Logs and other per-host files: next to the checkpoints when they are local."""
        root = Path(LOCAL_RUNS).resolve() if self.remote else Path(self.path)
        return root / run_name

    def checkpoints(self, run_name: str) -> list[str]:
        """The run's checkpoint directory names, oldest first."""
        steps = checkpoint_steps(self.filesystem, self.run_path(run_name))
        return sorted(steps, key=steps.get)

    def set_aside_unreadable_record(self, run_name: str) -> str | None:
        """When Ray Train's record of this run's checkpoints cannot be read, move it aside
        (to `.unreadable`) and return the run's newest checkpoint: the workers restore that
        one, or the newest intact one before it. None when the record is fine, or absent from
        a run that never had one set aside."""
        path = f"{self.run_path(run_name)}/{RAY_CHECKPOINT_RECORD}"
        try:
            record = self.read_json(path)
        except ValueError:  # cut short (JSON), or cut inside a character (UTF-8)
            self.filesystem.move(path, f"{path}.unreadable")
        else:
            set_aside_before = self.filesystem.get_file_info(f"{path}.unreadable").type == pafs.FileType.File
            if record is not None or not set_aside_before:  # sound, or a run with none yet
                return None
            # set aside by an earlier attempt that then committed no checkpoint of its own
        names = self.checkpoints(run_name)
        return f"{self.run_uri(run_name)}/{names[-1]}" if names else None

    def newest_logged_through(self, run_name: str, logged_until: int) -> str | None:
        """The newest checkpoint after which MLflow misses no step, for a run whose record Ray
        Train lost: each checkpoint carries only the steps since the one before it (its
        trainer state's `recent`), so a newer one whose first such step is past the last
        logged one would leave a gap. Without one, the oldest readable (the smallest gap)."""
        readable = []
        for name in reversed(self.checkpoints(run_name)):
            first = self._first_carried_step(f"{self.run_path(run_name)}/{name}/{TRAINER_STATE}")
            if first is None:  # cut short or foreign: the workers would pass it over too
                continue
            readable.append(name)
            if first <= logged_until + 1:
                return f"{self.run_uri(run_name)}/{name}"
        return f"{self.run_uri(run_name)}/{readable[-1]}" if readable else None

    def _first_carried_step(self, trainer_state: str) -> int | None:
        try:
            state = self.read_json(trainer_state)
            carried = [record["step"] for record in state["recent"]["steps"]]
            return min(carried, default=state["position"]["step"] + 1)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read_json(self, path: str) -> Any:
        if self.filesystem.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.filesystem.open_input_stream(path) as f:
            return json.loads(f.read().decode())

    def write_json(self, path: str, value: Any) -> None:
        with self.filesystem.open_output_stream(path) as f:
            f.write(json.dumps(value, indent=1).encode())

    def replace_dir(self, source: str, target: str) -> None:
        """Copy directory `source` to `target`, replacing what was there."""
        if self.filesystem.get_file_info(target).type != pafs.FileType.NotFound:
            self.filesystem.delete_dir(target)
        self.filesystem.create_dir(target)
        pafs.copy_files(
            source, target, source_filesystem=self.filesystem, destination_filesystem=self.filesystem
        )


def _endpoint_options(endpoint: str) -> dict[str, Any]:
    """S3FileSystem's options for `checkpoint.endpoint`. Credentials written into it
    (`https://KEY:SECRET@host`) are used to open the storage and never recorded;
    without them, pyarrow finds them in AWS_* variables or ~/.aws/credentials."""
    parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    host = parsed.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    options: dict[str, Any] = {"endpoint_override": f"{netloc}:{parsed.port}" if parsed.port else netloc}
    options["scheme"] = parsed.scheme
    if parsed.username and parsed.password:
        options.update(access_key=unquote(parsed.username), secret_key=unquote(parsed.password))
    return options


def open_storage(storage: str, endpoint: str | None = None) -> Storage:
    """The filesystem for `checkpoint.storage` (and `checkpoint.endpoint` for S3-compatible servers)."""
    if storage.startswith("s3://"):
        bucket_and_prefix = storage[len("s3://") :].strip("/")
        options: dict[str, Any] = {}
        if endpoint:
            options = _endpoint_options(endpoint)
        try:
            filesystem = pafs.S3FileSystem(**options)
        except Exception as exc:
            raise StorageError(f"checkpoint.storage: cannot open {storage}: {redact(str(exc))}") from exc
        return Storage(f"s3://{bucket_and_prefix}", bucket_and_prefix, filesystem, remote=True)
    if "://" in storage:
        raise StorageError(f"checkpoint.storage: '{storage}' is neither a directory nor s3://bucket/prefix")
    root = Path(storage).resolve()
    return Storage(str(root), str(root), pafs.LocalFileSystem(), remote=False)


def probe(storage: Storage) -> None:
    """Write and delete a small file, so that unusable storage fails before training starts."""
    marker = f"{storage.path}/.shoal-write-probe"
    try:
        storage.filesystem.create_dir(storage.path)
        with storage.filesystem.open_output_stream(marker) as f:
            f.write(b"ok")
        storage.filesystem.delete_file(marker)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageError(f"checkpoint.storage: cannot write to {storage.uri}: {reason}") from exc
