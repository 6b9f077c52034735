"""Evaluation over a rank's val shard, and what one batch adds to it (the loss of each task
lives in models/objective.py, shared with the cost trace and the pre-launch checks)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shoal.messages import VAL_PREFIX, Metric, model_metric
from shoal.worker.reporting import agreed_names


class BatchTotals(NamedTuple):
    """One evaluated batch: sums over its samples (zeros on loss-less pipeline stages)."""

    loss_sum: float
    correct: float
    samples: float
    metric_sums: dict[str, float]  # the model's metrics x samples


def evaluate(
    engine: Any,
    shard: Any,
    task: str,
    batch_size: int,
    world_size: int,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Loss (accuracy for classify, the model's own metrics as `val/<name>`) over this rank's
    val shard, averaged over every rank's samples.

    Pipelines need every batch the same shape, so they skip a short last batch.
    """
    totals = torch.zeros(3, dtype=torch.float64)  # loss x n, correct, n
    metric_sums: dict[str, float] = {}
    measured = False
    drop_last = engine.pipeline is not None
    for index, batch in enumerate(shard.iter_torch_batches(batch_size=batch_size, drop_last=drop_last)):
        if max_batches is not None and index >= max_batches:
            break
        result = engine.eval_batch(engine.combine(batch))
        totals += torch.tensor(result[:3], dtype=torch.float64)
        for name, value in result.metric_sums.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value
        measured = measured or result.samples > 0
    names = agreed_names(sorted(metric_sums) if measured else None, world_size, "evaluation")
    values = torch.cat([totals, torch.tensor([metric_sums.get(n, 0.0) for n in names], dtype=torch.float64)])
    if world_size > 1:
        dist.all_reduce(values)
    loss_sum, correct, count = values[:3].tolist()
    if count == 0:
        return {}
    results = {Metric.VAL_LOSS.value: loss_sum / count}
    if task == "classify":
        results[Metric.VAL_ACCURACY.value] = correct / count
    for name, total in zip(names, values[3:].tolist(), strict=True):
        results[model_metric(VAL_PREFIX, name)] = total / count
    return results
