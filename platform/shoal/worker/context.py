"""The trainer's one door to its cluster.

The Trainer makes exactly four kinds of calls to Ray Train: who am I (ranks),
my dataset shard, report (metrics and a checkpoint), and the latest checkpoint.
They go through a `TrainContext` handed to it, so the loop's decisions (NaN skip
and rollback, save and report cadence, resize arithmetic) run in unit tests with
an in-process context and no cluster (as Ray Train V2 tests its controller with
a `DummyWorkerGroup`). `RayTrainContext` is the real one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol


class StoredCheckpoint(Protocol):
    """A committed checkpoint directory in the run's storage (a `ray.train.Checkpoint`)."""

    path: str
    filesystem: Any  # a pyarrow filesystem

    def as_directory(self) -> AbstractContextManager[str]: ...


class TrainContext(Protocol):
    world_rank: int
    world_size: int
    local_rank: int
    head_address: str | None  # `host:port` of the cluster's head (links are timed to it)

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None = None,
        checkpoint_name: str | None = None,
        upload_in_background: bool = False,
    ) -> None:
        """Send metrics (and this rank's checkpoint files) to the driver. Collective: every
        rank calls it at the same point. A background upload deletes `checkpoint_dir`."""
        ...

    def latest_checkpoint(self) -> StoredCheckpoint | None: ...

    def checkpoint_at(self, path: str, filesystem: Any = None) -> StoredCheckpoint: ...


class RayTrainContext:
    """`TrainContext` over `ray.train` inside a Ray Train worker."""

    def __init__(self) -> None:
        import ray  # lazy: the worker module imports without Ray (unit tests)
        import ray.train

        self._train = ray.train
        context = ray.train.get_context()
        self.world_rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.local_rank = context.get_local_rank()
        self.head_address = ray.get_runtime_context().gcs_address

    def report(
        self,
        metrics: dict[str, Any],
        checkpoint_dir: Path | None = None,
        checkpoint_name: str | None = None,
        upload_in_background: bool = False,
    ) -> None:
        checkpoint, options = None, {}
        if checkpoint_dir is not None:
            checkpoint = self._train.Checkpoint.from_directory(str(checkpoint_dir))
        if upload_in_background:  # Ray copies to storage on a thread, then deletes the local files
            options = {
                "checkpoint_upload_mode": self._train.CheckpointUploadMode.ASYNC,
                "delete_local_checkpoint_after_upload": True,
            }
        self._train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name, **options)

    def latest_checkpoint(self) -> StoredCheckpoint | None:
        return self._train.get_checkpoint()

    def checkpoint_at(self, path: str, filesystem: Any = None) -> StoredCheckpoint:
        return self._train.Checkpoint(path, filesystem=filesystem)
