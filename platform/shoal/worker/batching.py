"""How a global batch splits into micro-batches and steps, whatever the world size."""

from __future__ import annotations

from shoal.spec.schema import TrainSpec, Workload


def accumulation_steps(global_batch: int, micro: int, world: int) -> int:
    if global_batch % (micro * world):
        raise ValueError(
            f"train.global_batch_size {global_batch} is not a multiple of "
            f"data.batch_size {micro} x {world} workers: this world size cannot keep the global batch"
        )
    return global_batch // (micro * world)


def global_batch_size(workload: Workload) -> int:
    """Rows per optimizer step, fixed for the whole run whatever the world size: the spec's
    global_batch_size, or batch_size x the largest number of workers."""
    configured = workload.train.global_batch_size
    if configured is not None:
        return configured
    return workload.data.batch_size * workload.scaling.worker_range()[1]


def planned_steps(train: TrainSpec, train_rows: int | None, global_batch: int) -> int:
    """Optimizer steps the run will take: max_steps, or what `epochs` of data give."""
    if train.max_steps is not None:
        return train.max_steps
    if not train_rows:
        raise ValueError("train.epochs needs the training set's row count; use train.max_steps")
    assert train.epochs is not None  # the schema asks for exactly one of the two
    return max(1, train.epochs * (train_rows // global_batch))
