"""Evaluation over a rank's share of the validation set (data/evaluation.py), and what one
batch adds to it (the loss of each task lives in models/objective.py, shared with the cost
trace and the pre-launch checks)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shoal.data.evaluation import evaluation_batches, slot_batches
from shoal.data.manifest import Manifest
from shoal.data.reader import ReadCounts, RowGroupReader, to_tensors
from shoal.messages import VAL_PREFIX, Metric, model_metric
from shoal.worker.reporting import agreed_names


class BatchTotals(NamedTuple):
    """One evaluated batch: sums over its samples (zeros on loss-less pipeline stages)."""

    loss_sum: float
    correct: float
    samples: float
    metric_sums: dict[str, float]  # the model's metrics x samples


class ValidationShare:
    """This rank's share of the validation set: the batches of its data-parallel slot, each
    of `micro` rows per rank of the slot (what `Engine.combine` makes of a training batch),
    read by the worker itself; footers are read once, at the first evaluation. With `keep`
    (`data.cache`), the batches stay in memory for the next evaluations."""

    def __init__(self, manifest_json: str, engine: Any, micro: int, max_batches: int | None, keep: bool):
        self.manifest = Manifest.from_json(manifest_json)
        self.reader = RowGroupReader(self.manifest, ReadCounts())
        self.slot, self.slots = engine.data_slot()
        self.batch_rows = micro * len(engine.mp_ranks)
        self.max_batches = max_batches
        self.whole_only = engine.pipeline is not None  # pipeline schedules need one batch shape
        # Sharded parameters are gathered across the slots in every forward pass: each slot
        # must run as many as the slot with the most batches.
        self.lockstep = engine.dims.uses_fsdp and self.slots > 1
        self.keep, self.kept, self.kept_filler = keep, None, None

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.kept is not None:
            return iter(self.kept)
        if self.keep:
            self.kept = list(self._read())
            return iter(self.kept)
        return self._read()

    def fillers(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches to run and leave out of the results, so that this slot makes as many
        forward passes as every other (none unless the parameters are sharded)."""
        if not self.lockstep:
            return iter(())
        counts = [len(self._indices(slot)) for slot in range(self.slots)]
        missing = max(counts) - counts[self.slot]
        if not missing:
            return iter(())
        filler = self.kept_filler or next(self._read(slot=self.slots - 1))  # the last slot has the most
        if self.keep:
            self.kept_filler = filler
        return iter([filler] * missing)

    def _indices(self, slot: int) -> range:
        rows, batch, most = self.manifest.total_rows, self.batch_rows, self.max_batches
        return slot_batches(rows, batch, slot, self.slots, most, self.whole_only)

    def _read(self, slot: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        tables = evaluation_batches(
            self.manifest,
            self.reader,
            self.batch_rows,
            self.slot if slot is None else slot,
            self.slots,
            self.max_batches,
            self.whole_only,
        )
        return (to_tensors(table) for table in tables)


def evaluate(
    engine: Any,
    batches: Iterable[dict[str, torch.Tensor]],
    task: str,
    world_size: int,
    fillers: Iterable[dict[str, torch.Tensor]] = (),
) -> dict[str, float]:
    """Loss (accuracy for classify, the model's own metrics as `val/<name>`) over this rank's
    batches, averaged over every rank's samples; `fillers` are run and left out."""
    totals = torch.zeros(3, dtype=torch.float64)  # loss x n, correct, n
    metric_sums: dict[str, float] = {}
    measured = False
    for batch in batches:
        result = engine.eval_batch(batch)
        totals += torch.tensor(result[:3], dtype=torch.float64)
        for name, value in result.metric_sums.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + value
        measured = measured or result.samples > 0
    for batch in fillers:
        engine.eval_batch(batch)
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
