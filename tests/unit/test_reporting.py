"""The worker's Reporter as the training loop uses it, over the in-process context (no Ray
cluster): what it sends is one WorkerReport in plain data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.messages import Event, EventKind, Metric, ProfileTrace, ReportSummary, StepRecord, WorkerReport
from shoal.worker.reporting import Reporter, StepStats
from tests.unit.local_context import LocalContext


@pytest.fixture
def context(tmp_path: Path) -> LocalContext:
    return LocalContext(tmp_path)


def reporter(context: LocalContext) -> Reporter:
    return Reporter(StepStats(world_size=1, interval_s=1e9, rank=0), context)


def test_a_report_carries_the_buffered_steps_events_and_profiles(context: LocalContext) -> None:
    buffered = reporter(context)
    record = buffered.record_step(StepRecord(1, 100.0, {Metric.TRAIN_LOSS: 2.5, Metric.TRAIN_LR: 0.1}))
    evaluation = buffered.event(EventKind.EVAL, step=1, **{"val/loss": 2.0})
    buffered.event(EventKind.for_nan_policy("skip"), step=2, loss="nan")
    trace = ProfileTrace(0, "rank0.steps1-1.pt.trace.json.gz", 1, 1, data="QQ==")
    buffered.profiles.append(trace)
    buffered.send(ReportSummary(1, 0, 8, 1, 10))

    (sent,) = context.reports
    assert sent.checkpoint is None
    report = WorkerReport.from_metrics(json.loads(json.dumps(sent.metrics)))  # plain data throughout
    assert report.summary == ReportSummary(1, 0, 8, 1, 10)
    assert report.steps == [record] == [StepRecord(1, 100.0, {"train/loss": 2.5, "train/lr": 0.1})]
    assert report.events[0] == evaluation and report.events[1].kind is EventKind.NAN_SKIP
    assert report.profiles == [trace]
    assert buffered.steps == [] and buffered.events == [] and buffered.profiles == []


def test_a_checkpoint_report_keeps_profiles_for_the_next_one(context: LocalContext, tmp_path: Path) -> None:
    buffered = reporter(context)
    buffered.profiles.append(ProfileTrace(0, "t.gz", 1, 1, path="/x/t.gz"))
    shard = tmp_path / "shard"
    shard.mkdir()
    (shard / "rank0.bin").write_bytes(b"weights")
    summary = ReportSummary(2, 0, 16, 1, 10, checkpointed=True)
    buffered.send(summary, checkpoint_dir=shard, checkpoint_name="checkpoint-00000002")
    (sent,) = context.reports
    assert "shoal_profiles" not in sent.metrics and sent.metrics["checkpointed"] is True
    assert sent.checkpoint == "checkpoint-00000002"
    assert (tmp_path / "checkpoint-00000002" / "rank0.bin").read_bytes() == b"weights"
    assert len(buffered.profiles) == 1


def test_records_restored_from_a_checkpoint_are_sent_again(context: LocalContext) -> None:
    """The loop puts a restored checkpoint's recent records back into the buffers."""
    buffered = reporter(context)
    buffered.steps = [StepRecord(5, 1.0, {"train/loss": 1.0}), *buffered.steps]
    buffered.events += [Event(EventKind.EVAL, 2.0, {"step": 5, "val/loss": 0.9})]
    buffered.send(ReportSummary(5, 0, 40, 1, 10))
    report = WorkerReport.from_metrics(context.reports[0].metrics)
    assert [s.step for s in report.steps] == [5] and report.events[0].fields == {"step": 5, "val/loss": 0.9}


def test_an_unknown_event_kind_fails_in_the_worker(context: LocalContext) -> None:
    with pytest.raises(ValueError):
        reporter(context).event("nan_explode")  # type: ignore[arg-type]
