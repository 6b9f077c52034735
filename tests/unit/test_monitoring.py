"""Monitoring logic without Ray: straggler detection, the per-rank slots of the step's
all-reduce, which MLflow failures are worth retrying, the end-of-run plot, meta tracing."""

from __future__ import annotations

import random
import statistics

import pytest
import requests
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from shoal.messages import EVENTS_KEY, STEPS_KEY, DataCount, EventKind, GpuReading, ReportSummary, StepRecord
from shoal.models.cost import trace_cost
from shoal.queue_messages import ReportMessage
from shoal.spec.schema import MonitorSpec
from shoal.tracking.artifacts import plot_run
from shoal.tracking.mlflow_run import is_unreachable
from shoal.worker import metrics
from shoal.worker.metrics import (
    PeakMemory,
    RankWatch,
    StragglerWatch,
    medians_of_others,
    per_rank_series,
    worker_metrics,
)
from shoal.worker.reporting import Reporter, StepStats


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


def test_per_rank_series_up_to_the_threshold_then_their_spread_and_the_stragglers_own() -> None:
    def named(rank: int) -> str:
        return f"worker/{rank}/busy_s"

    assert per_rank_series([0.1, 0.3], named, "worker/busy_s", 8, set()) == {
        "worker/0/busy_s": 0.1,
        "worker/1/busy_s": 0.3,
    }
    values = [0.1] * 63 + [0.5]
    values[7] = 0.05
    assert per_rank_series(values, named, "worker/busy_s", 8, {63}) == {
        "worker/63/busy_s": 0.5,
        "worker/busy_s/min": 0.05,
        "worker/busy_s/median": 0.1,
        "worker/busy_s/max": 0.5,
        "worker/busy_s/max_rank": 63.0,
    }
    no_reading = per_rank_series([-1.0] * 16, named, "worker/busy_s", 8, {3})  # a link not yet timed
    assert no_reading == {}


def test_rows_per_step_stay_flat_beyond_the_threshold() -> None:
    def rows(world: int) -> int:
        gathered = {
            "busy_s": [0.01 * (r % 7) for r in range(world)],
            "link_rtt_s": [0.0002] * world,
            "peak_mb": [100.0] * world,
            **{reading: [1.0] * world for reading in GpuReading},
        }
        return len(worker_metrics(gathered, gpus=True, up_to=8, keep={1}))

    assert rows(2) < rows(8) and rows(9) == rows(64) == rows(1024) < rows(8)


def test_a_flagged_straggler_keeps_its_own_series_from_the_step_it_is_flagged() -> None:
    watch = RankWatch(MonitorSpec(stragglers={"factor": 2.0, "steps": 2, "min_gap_s": 0.01}))
    world, shown = 32, []
    for step in range(1, 5):
        gathered = {
            "busy_s": [0.01] * 31 + [0.2],
            "link_rtt_s": [-1.0] * world,
            "link_address": [-1.0] * world,
            "peak_mb": [1.0] * world,
        }
        events = watch.observe(step, gathered)
        shown.append(
            ("worker/31/busy_s" in watch.step_metrics(gathered, gpus=False), [e["kind"] for e in events])
        )
    assert shown == [(False, []), (True, ["straggler"]), (True, []), (True, [])]
    epoch = watch.epoch_metrics({f"data/{count}": [10.0] * world for count in DataCount})
    assert epoch["data/bytes_read"] == 320.0 and epoch["data/bytes_read/max"] == 10.0
    assert "data/31/bytes_read" in epoch and "data/0/bytes_read" not in epoch


class Reports:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def report(self, metrics: dict, *args: object) -> None:
        self.sent.append(metrics)


def test_only_rank_0_sends_the_records_the_driver_reads() -> None:
    sent = {}
    for rank in (0, 1):
        context = Reports()
        reporter = Reporter(StepStats(world_size=2, interval_s=1e9, rank=rank), context)  # type: ignore[arg-type]
        reporter.record_step(StepRecord(1, 1.0, {"train/loss": 2.0}))
        reporter.event(EventKind.EVAL, step=1)
        reporter.send(ReportSummary(1, 0, 8, 2, 10))
        sent[rank] = context.sent[0]
    message = ReportMessage.from_ranks([sent[0], sent[1]], None)
    assert [r.step for r in message.steps] == [1] and [e.kind for e in message.events] == [EventKind.EVAL]
    assert sent[1]["step"] == 1 and sent[1][STEPS_KEY] == [] and sent[1][EVENTS_KEY] == []


def _links(readings: list[float]) -> dict[str, list[float]]:
    world = len(readings)
    return {
        "busy_s": [0.01] * world,
        "link_rtt_s": readings,
        "link_address": [-1.0] * world,
        "peak_mb": [1.0] * world,
    }


def test_a_link_reading_is_a_point_at_the_step_it_came_and_not_at_each_step_after() -> None:
    watch = RankWatch(MonitorSpec())
    shown = []
    for readings in ([0.001, -1.0], [0.001, 0.002], [0.001, 0.002], [0.003, 0.002]):
        metrics = watch.step_metrics(_links(readings), gpus=False)
        shown.append({k: v for k, v in metrics.items() if "link_rtt" in k})
    assert shown == [
        {"worker/0/link_rtt_s": 0.001},
        {"worker/1/link_rtt_s": 0.002},
        {},
        {"worker/0/link_rtt_s": 0.003},
    ]


def test_beyond_the_threshold_the_links_spread_is_a_point_when_any_rank_has_a_new_reading() -> None:
    watch = RankWatch(MonitorSpec())
    first = [0.001] * 15 + [0.004]
    spread = [watch.step_metrics(_links(r), gpus=False).get("worker/link_rtt_s/max") for r in (first, first)]
    newer = first[:3] + [0.009] + first[4:]  # rank 3 timed again: the spread is over every rank's latest
    spread.append(watch.step_metrics(_links(newer), gpus=False).get("worker/link_rtt_s/max"))
    assert spread == [0.004, None, 0.009]


def test_medians_of_others_are_statistics_median_of_the_rest() -> None:
    rng = random.Random(7)
    cases = [[0.5, 0.1], [0.1, 0.1, 0.1], [3.0, 1.0, 2.0, 2.0]]
    cases += [
        [rng.choice([0.1, 0.2, rng.random()]) for _ in range(n)] for n in range(2, 40) for _ in range(5)
    ]
    for values in cases:
        expected = [statistics.median(values[:i] + values[i + 1 :]) for i in range(len(values))]
        assert medians_of_others(values) == expected, values


def test_peak_memory_is_read_at_most_once_a_second_on_cpu_and_every_time_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now, reads = [100.0], []
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(
        metrics, "peak_memory_mb", lambda device: reads.append(device.type) or 10.0 * len(reads)
    )
    cpu = PeakMemory(torch.device("cpu"))
    assert [cpu.read(), cpu.read()] == [10.0, 10.0] and reads == ["cpu"]
    now[0] += 0.99
    assert cpu.read() == 10.0 and len(reads) == 1
    now[0] += 0.02
    assert cpu.read() == 20.0 and len(reads) == 2
    gpu = PeakMemory(torch.device("cuda", 0))  # CUDA's counter is a read of host memory: no cache
    assert [gpu.read(), gpu.read()] == [30.0, 40.0] and reads[2:] == ["cuda", "cuda"]
