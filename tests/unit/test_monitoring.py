"""Monitoring logic without Ray: straggler detection, the per-rank slots of the step's
all-reduce, which MLflow failures are worth retrying, the end-of-run plot, meta tracing."""

from __future__ import annotations

import pytest
import requests
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from shoal.models.cost import trace_cost
from shoal.tracking.artifacts import plot_run
from shoal.tracking.mlflow_run import is_unreachable
from shoal.worker.metrics import StragglerWatch, worker_metrics
from shoal.worker.reporting import StepStats


def test_a_straggler_is_flagged_once_after_k_slow_steps_and_recovers() -> None:
    watch = StragglerWatch(factor=1.5, steps=3, min_gap_s=0.01)
    events = []
    for step, slow in enumerate([0.05, 0.05, 0.05, 0.05, 0.05, 0.01], start=1):
        events += watch.observe(step, [0.01, slow, 0.011, 0.012])
    kinds = [(e["kind"], e["rank"], e["step"]) for e in events]
    assert kinds == [("straggler", 1, 3), ("straggler_recovered", 1, 6)]
    assert events[0]["median_s"] == 0.011 and events[0]["ratio"] == pytest.approx(4.55, abs=0.01)


def test_noise_below_the_gap_or_broken_streaks_are_not_stragglers() -> None:
    watch = StragglerWatch(factor=1.5, steps=3, min_gap_s=0.01)
    assert watch.observe(1, [0.001, 0.004]) == []  # 4x slower but only 3 ms apart
    events = []
    for step, slow in enumerate([0.05, 0.05, 0.01, 0.05, 0.05], start=1):
        events += watch.observe(step, [0.01, slow])
    assert events == []
    assert StragglerWatch(1.5, 1, 0.0).observe(1, [5.0]) == []  # one worker has no others


def test_step_stats_gather_per_rank_values_on_one_rank() -> None:
    stats = StepStats(world_size=1, interval_s=1e9, rank=0)
    loss, due, written, gathered, _ = stats.reduce(2.0, 1.0, True, {"busy_s": 0.25, "peak_mb": 512.0})
    assert (loss, due, written) == (2.0, False, True)
    assert gathered == {"busy_s": [0.25], "peak_mb": [512.0]}
    metrics = worker_metrics(gathered, gpus=False)
    assert metrics == {
        "worker/0/busy_s": 0.25,
        "time/busy_max_s": 0.25,
        "time/busy_median_s": 0.25,
        "memory/peak_mb": 512.0,
    }


def test_only_an_unreachable_store_is_retried() -> None:
    assert is_unreachable(requests.exceptions.ConnectionError("refused"))
    assert is_unreachable(MlflowException("API request to http://x failed with exception ..."))
    assert not is_unreachable(MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE))
    assert not is_unreachable(ValueError("a bug"))


def test_plot_needs_losses_and_draws_a_png(tmp_path) -> None:
    assert plot_run({}, "empty", tmp_path / "none.png") is None
    series = {"train/loss": [(1, 2.0), (2, 1.5)], "val/loss": [(2, 1.6)], "train/samples_per_s": [(1, 9.0)]}
    path = plot_run(series, "run", tmp_path / "plot.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_meta_trace_counts_the_flops_of_a_linear_model() -> None:
    cost = trace_cost(
        {"family": "mlp", "args": {"in_features": 64, "hidden": 32, "layers": 1, "num_classes": 10}},
        "classify",
        {"x": ((64,), torch.float32), "y": ((), torch.int64)},
    )
    forward = 2 * (64 * 32 + 32 * 10)  # multiply-adds of the two Linear layers, per sample
    # backward: the input of the first layer needs no gradient, so 2x forward minus that matmul
    assert cost.flops_per_sample == pytest.approx(forward + 2 * forward - 2 * 64 * 32)
    assert cost.parameters == 64 * 32 + 32 + 32 * 10 + 10
