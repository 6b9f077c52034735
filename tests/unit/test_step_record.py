"""A step's record (worker/step_record.py) and the stream helpers the loop groups steps
with (worker/stream.py): the time between steps goes into the next record and only
there; throughput and FLOPs follow from the step's wall time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shoal.messages import Metric, checkpoint_phase_metric
from shoal.worker.step_record import Stalls, StepTiming, step_values, tokens_per_s
from shoal.worker.stream import optimizer_steps, timed


def test_stalls_add_up_by_metric_and_phase_and_are_taken_once() -> None:
    stalls = Stalls()
    stalls.add(Metric.TIME_EVAL_S, 0.5)
    stalls.add(Metric.TIME_REPORT_S, 0.25)
    stalls.add_checkpoint({"staging": 0.1, "state_dict": 0.02})
    stalls.add_checkpoint({"staging": 0.3})
    taken = stalls.take()
    assert taken[Metric.TIME_EVAL_S] == 0.5 and taken[Metric.TIME_REPORT_S] == 0.25
    assert taken[checkpoint_phase_metric("staging")] == pytest.approx(0.4)
    assert taken[checkpoint_phase_metric("state_dict")] == pytest.approx(0.02)
    assert taken[Metric.TIME_CHECKPOINT_S] == pytest.approx(0.42)
    # the next step's record has none: a stall is a point only at the step after it happened
    assert stalls.take() == {}


def _engine(scaler: bool = False) -> SimpleNamespace:
    precision = SimpleNamespace(scaler=object() if scaler else None, skipped_steps=3)
    return SimpleNamespace(lr=1e-3, last_grad_norm=0.7, precision=precision)


def test_step_values_follow_from_the_steps_wall_time() -> None:
    timing = StepTiming(elapsed=0.5, data_wait=0.1, phases={"forward_backward": 0.3, "forward": 0.1})
    values = step_values(_engine(), 2.5, timing, samples=64, world=4, flops_per_step=2e12)
    assert values[Metric.TRAIN_LOSS] == 2.5 and values[Metric.TRAIN_LR] == 1e-3
    assert values[Metric.TRAIN_SAMPLES_PER_S] == 128 and values[Metric.TRAIN_SAMPLES_PER_S_PER_WORKER] == 32
    assert values[Metric.TRAIN_DATA_WAIT_SHARE] == pytest.approx(0.2)
    assert values[Metric.TIME_STEP_S] == 0.5 and values[Metric.TIME_OPTIMIZER_S] == 0.0
    assert values[Metric.PERF_TFLOPS] == 4 and values[Metric.PERF_TFLOPS_PER_WORKER] == 1
    assert Metric.TRAIN_SKIPPED_STEPS not in values


def test_no_flop_metrics_without_a_flop_count_and_fp16_counts_skipped_steps() -> None:
    timing = StepTiming(elapsed=1.0, data_wait=0.0)
    values = step_values(_engine(scaler=True), 1.0, timing, samples=8, world=2, flops_per_step=0.0)
    assert Metric.PERF_TFLOPS not in values and values[Metric.TRAIN_SKIPPED_STEPS] == 3


def test_tokens_per_s_counts_predicted_tokens() -> None:
    rates = tokens_per_s(samples=8, predicted_per_sample=127, elapsed=2.0, world=4)
    assert rates == {Metric.TRAIN_TOKENS_PER_S: 508.0, Metric.TRAIN_TOKENS_PER_S_PER_WORKER: 127.0}


def test_optimizer_steps_group_micro_batches_in_order() -> None:
    assert list(optimizer_steps(range(6), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(optimizer_steps(range(4), 1)) == [[0], [1], [2], [3]]


def test_timed_reports_one_wait_per_item_and_one_for_the_end() -> None:
    waits: list[float] = []
    assert list(timed(iter("abc"), waits.append)) == ["a", "b", "c"]
    assert len(waits) == 4 and all(w >= 0 for w in waits)
