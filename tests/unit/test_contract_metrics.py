"""The model's own metrics: averaged over micro-batches and ranks through the one StepStats
all-reduce, logged as train/<name> and val/<name>, the same names on every rank (no Ray)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

# -- the model's metrics over two ranks (the real Trainer on LocalContext) ------------------

ID_MODEL = (
    "import torch, torch.distributed as dist\n"
    "class IdNet(torch.nn.Module):\n"
    "    def __init__(self, odd_rank_metric=False):\n"
    "        super().__init__()\n"
    "        self.fc = torch.nn.Linear(4, 1)\n"
    "        self.odd_rank_metric = odd_rank_metric\n"
    "    def forward(self, features, target, ids):\n"
    "        error = self.fc(features).squeeze(-1) - target\n"
    "        out = {'loss': (error ** 2).mean(), 'id_mean': ids.float().mean()}\n"
    "        if self.odd_rank_metric and dist.get_rank() == 1:\n"
    "            out['only_here'] = error.abs().mean()\n"
    "        return out\n"
)


def _custom_rank(rank: int, port: int, tmp_path: Path, spec: dict) -> None:
    import json
    import os

    import torch.distributed as dist

    from shoal.spec.schema import Workload
    from shoal.worker.config import WorkerConfig
    from shoal.worker.loop import Trainer
    from tests.unit.local_context import LocalContext, parquet_manifest

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(tmp_path))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(0)
    rows = {"f": torch.randn(64, 4, generator=generator), "t": torch.randn(64, generator=generator)}
    context = LocalContext(tmp_path / "storage", rank, 2)
    manifest = parquet_manifest(tmp_path / f"data-{rank}", {**rows, "id": torch.arange(64)})
    config = WorkerConfig(Workload.model_validate(spec), "custom", str(tmp_path / "run"), 1e9, 1, manifest)
    Trainer(config, context).run()
    last = context.reports[-1].metrics
    outcome = {
        "steps": context.step_records(),
        "fatal": context.events("fatal"),
        "stopped": last.get("fatal"),
    }
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.barrier()  # no rank tears gloo down while another still reads the last collective
    dist.destroy_process_group()


def _two_rank_run(tmp_path: Path, odd_rank_metric: bool) -> list[dict]:
    import json

    import torch.multiprocessing as mp

    from tests.unit.parallel_harness import free_port

    (tmp_path / "id_net.py").write_text(ID_MODEL)
    (tmp_path / "storage").mkdir()
    spec = {
        "name": "custom-ranks",
        "model": {"target": "id_net:IdNet", "task": "custom", "args": {"odd_rank_metric": odd_rank_metric}},
        "data": {
            "train": {"path": "in-memory"},
            "batch_size": 8,
            "shuffle_buffer": 0,
            "columns": {"f": "features", "t": "target", "id": "ids"},
        },
        "train": {"max_steps": 3, "optimizer": {"lr": 0.01}},
        "scaling": {"workers": 2},
    }
    mp.start_processes(_custom_rank, args=(free_port(), tmp_path, spec), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_model_metrics_are_averaged_over_ranks_and_logged_as_train_metrics(tmp_path: Path) -> None:
    lead, other = _two_rank_run(tmp_path, odd_rank_metric=False)
    steps = lead["steps"]  # rank 0's records are the ones the driver logs
    # Two lanes of 32 rows, read in order: step s (from 0) trains rows 8s..8s+7 on rank 0 and
    # 32+8s..32+8s+7 on rank 1; the logged value is the mean id over both ranks.
    assert [record["train/id_mean"] for record in steps] == [19.5, 27.5, 35.5]
    assert all(math.isfinite(record["train/loss"]) for record in steps)
    assert other["steps"] == []  # the other ranks report their summary alone


def test_ranks_whose_models_return_different_metrics_stop_together(tmp_path: Path) -> None:
    lead, other = _two_rank_run(tmp_path, odd_rank_metric=True)
    reason = (
        "the model returned different metrics on different ranks in training "
        "(rank 0: ['id_mean']; rank 1: ['id_mean', 'only_here'])"
    )
    (fatal,) = lead["fatal"]  # the event, as the driver reads it from rank 0
    assert fatal["reason"] == reason
    for outcome in (lead, other):  # every rank stopped with it, no step logged
        assert outcome["stopped"] == reason and outcome["steps"] == []


def test_metric_names_that_are_shoals_own_are_refused_by_task() -> None:
    from shoal.messages import model_metric_problem

    assert model_metric_problem("mae", "custom") is None
    assert model_metric_problem("accuracy", "custom") is None  # shoal measures accuracy for classify only
    assert "val/accuracy" in (model_metric_problem("accuracy", "classify") or "")
    assert "train/grad_norm" in (model_metric_problem("grad_norm", "custom") or "")
    assert "must be letters" in (model_metric_problem("a|b", "custom") or "")


def test_metrics_that_change_after_the_first_step_stop_the_run() -> None:
    from shoal.worker.reporting import MetricNamesError, StepStats

    stats = StepStats(world_size=1, interval_s=1e9, rank=0)
    first = stats.reduce(1.0, metrics={"mae": 0.5, "rmse": 0.25})
    assert first.metrics == {"mae": 0.5, "rmse": 0.25} and first.loss == 1.0
    with pytest.raises(
        MetricNamesError, match=r"changed during training \(the first step had \['mae', 'rmse'\]\)"
    ):
        stats.reduce(1.0, metrics={"mae": 0.5})


def test_evaluation_logs_the_models_metrics_as_val_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.spec.schema import Workload
    from shoal.worker.config import WorkerConfig
    from shoal.worker.loop import Trainer
    from tests.unit.local_context import LocalContext, parquet_manifest

    (tmp_path / "id_net_eval.py").write_text(ID_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {
        "name": "custom-eval",
        "model": {"target": "id_net_eval:IdNet", "task": "custom"},
        "data": {
            "train": {"path": "in-memory"},
            "batch_size": 8,
            "columns": {"f": "features", "t": "target", "id": "ids"},
        },
        "train": {"max_steps": 2, "eval_every": 2},
    }
    rows = {"f": torch.randn(32, 4), "t": torch.randn(32), "id": torch.arange(32)}
    val = {"f": torch.randn(16, 4), "t": torch.randn(16), "id": torch.arange(100, 116)}
    (tmp_path / "storage").mkdir()
    context = LocalContext(tmp_path / "storage")
    config = WorkerConfig(
        Workload.model_validate(spec),
        "custom",
        str(tmp_path / "run"),
        1e9,
        1,
        train_manifest=parquet_manifest(tmp_path / "data", rows),
        val_manifest=parquet_manifest(tmp_path / "val", val, rows_per_group=5),
    )
    Trainer(config, context).run()
    (evaluation,) = context.events("eval")
    assert evaluation["val/id_mean"] == pytest.approx(107.5)  # the mean id over the whole val set
    assert math.isfinite(evaluation["val/loss"]) and "val/accuracy" not in evaluation
