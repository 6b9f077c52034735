"""Loss and evaluation for each task: `classify` (x -> y) and `lm` (next byte)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shoal.messages import Metric
from shoal.models.outputs import unpack_outputs


def batch_size_of(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values())))


def forward_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], task: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss over the batch, and the number of correct predictions (classify only) as a
    tensor, so that training, which ignores it, does not wait on the device for it."""
    if task == "classify":
        x = batch["x"].to(device, dtype=torch.float32, non_blocking=True)
        y = batch["y"].to(device, dtype=torch.long, non_blocking=True)
        logits = unpack_outputs(model(x)).logits
        correct = (logits.argmax(dim=-1) == y).sum()
        return F.cross_entropy(logits.float(), y), correct
    tokens = batch["tokens"].to(device, non_blocking=True).long()
    logits = unpack_outputs(model(tokens[:, :-1])).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()), torch.zeros(())


def evaluate(
    engine: Any,
    shard: Any,
    task: str,
    batch_size: int,
    world_size: int,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Loss (and accuracy) over this rank's val shard, summed over every rank.

    Pipelines need every batch the same shape, so they skip a short last batch.
    """
    totals = torch.zeros(3, dtype=torch.float64)  # loss x n, correct, n
    drop_last = engine.pipeline is not None
    for index, batch in enumerate(shard.iter_torch_batches(batch_size=batch_size, drop_last=drop_last)):
        if max_batches is not None and index >= max_batches:
            break
        totals += torch.tensor(engine.eval_batch(engine.combine(batch)), dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    if count == 0:
        return {}
    results = {Metric.VAL_LOSS.value: loss_sum / count}
    if task == "classify":
        results[Metric.VAL_ACCURACY.value] = correct / count
    return results
