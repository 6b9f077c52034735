"""An in-process `TrainContext`: the real Trainer, Engine and checkpoints, no Ray.

The training and validation sets are written to parquet (`parquet_manifest`) and read by
the worker's own readers, as in a run. `report` commits a checkpoint the way Ray Train
does (every rank's files copied into one directory in storage, then it is the latest) and
keeps every report for the test to read.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from shoal.data.manifest import build_manifest


def parquet_manifest(directory: Path, columns: dict[str, torch.Tensor], rows_per_group: int = 16) -> str:
    """Write tensors (one row per first-dimension index) to a parquet file in `directory`, and
    return its manifest as the JSON a WorkerConfig carries."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, tensor in columns.items():
        values = tensor.numpy()
        array = pa.array(values.reshape(-1))
        for size in reversed(values.shape[1:]):
            array = pa.FixedSizeListArray.from_arrays(array, size)
        arrays[name] = array
    path = directory / "train.parquet"
    pq.write_table(pa.table(arrays), path, row_group_size=rows_per_group)
    return build_manifest([str(path)]).to_json()


@dataclass
class LocalCheckpoint:
    path: str
    filesystem: Any = field(default_factory=pafs.LocalFileSystem)

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        yield self.path


@dataclass
class Report:
    metrics: dict[str, Any]
    checkpoint: str | None  # the checkpoint directory's name in storage


class LocalContext:
    def __init__(
        self,
        storage: Path,
        world_rank: int = 0,
        world_size: int = 1,
        latest: str | None = None,
    ):
        self.storage = storage
        self.world_rank, self.world_size, self.local_rank = world_rank, world_size, world_rank
        self.head_address = None  # no cluster: links are not timed
        self.latest = LocalCheckpoint(latest) if latest else None
        self.reports: list[Report] = []

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None = None,
        checkpoint_name: str | None = None,
        upload_in_background: bool = False,
    ) -> None:
        if checkpoint_dir is not None:
            assert checkpoint_name is not None
            target = self.storage / checkpoint_name
            shutil.copytree(checkpoint_dir, target, dirs_exist_ok=True)
            if upload_in_background:
                shutil.rmtree(checkpoint_dir)
        if dist.is_initialized():
            dist.barrier()  # like Ray Train: committed once every rank has handed its files over
        if checkpoint_name is not None:
            self.latest = LocalCheckpoint(str(self.storage / checkpoint_name))
        self.reports.append(Report(metrics, checkpoint_name))

    def latest_checkpoint(self) -> LocalCheckpoint | None:
        return self.latest

    def checkpoint_at(self, path: str, filesystem: Any = None) -> LocalCheckpoint:
        return LocalCheckpoint(path)

    def step_records(self) -> list[dict[str, Any]]:
        return [record for report in self.reports for record in report.metrics["shoal_steps"]]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for report in self.reports for e in report.metrics["shoal_events"] if e["kind"] == kind]
