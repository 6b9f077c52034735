"""The worker's Reporter as the training loop uses it, with `ray.train.report` replaced by a
list (no Ray cluster): what it sends is one WorkerReport in plain data."""

from __future__ import annotations

import json
from typing import Any

import pytest
import ray.train

from shoal.messages import Event, EventKind, Metric, ReportSummary, StepRecord, WorkerReport
from shoal.worker.reporting import Reporter, StepStats


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    reports: list[tuple[dict[str, Any], dict[str, Any]]] = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, **options: reports.append((metrics, options)))
    return reports


def _summary(step: int, **extra: Any) -> dict[str, Any]:
    """What the loop's `_summary()` passes today."""
    return {"step": step, "epoch": 0, "samples": 8 * step, "world_size": 1, "total_steps": 10, **extra}


def test_a_report_carries_the_buffered_steps_events_and_profiles(sent: list) -> None:
    reporter = Reporter(StepStats(world_size=1, interval_s=1e9, rank=0))
    loop_record = {"step": 1, "time": 100.0, "train/loss": 2.5, Metric.TRAIN_LR: 0.1}
    assert reporter.record_step(loop_record) == StepRecord(1, 100.0, {"train/loss": 2.5, "train/lr": 0.1})
    evaluation = reporter.event("eval", step=1, **{"val/loss": 2.0})
    reporter.event(EventKind.for_nan_policy("skip"), step=2, loss="nan")
    assert json.loads(json.dumps(reporter.events[-1]))["kind"] == "nan_skip"  # checkpointed as JSON
    trace = {
        "rank": 0,
        "name": "rank0.steps1-1.pt.trace.json.gz",
        "first_step": 1,
        "last_step": 1,
        "data": "QQ==",
    }
    reporter.profiles.append(trace)
    reporter.send(_summary(1))

    ((metrics, options),) = sent
    assert options == {"checkpoint": None, "checkpoint_dir_name": None}
    report = WorkerReport.from_metrics(json.loads(json.dumps(metrics)))
    assert report.summary == ReportSummary(1, 0, 8, 1, 10)
    assert report.steps == [StepRecord(1, 100.0, {"train/loss": 2.5, "train/lr": 0.1})]
    assert report.events[0] == evaluation and report.events[1].kind is EventKind.NAN_SKIP
    assert [t.to_dict() for t in report.profiles] == [trace]
    assert reporter.steps == [] and reporter.events == [] and reporter.profiles == []


def test_a_checkpoint_report_keeps_profiles_for_the_next_one(sent: list) -> None:
    reporter = Reporter(StepStats(world_size=1, interval_s=1e9, rank=0))
    reporter.profiles.append({"rank": 0, "name": "t.gz", "first_step": 1, "last_step": 1, "path": "/x/t.gz"})
    checkpoint = object()
    reporter.send(ReportSummary(2, 0, 16, 1, 10, checkpointed=True), checkpoint, "checkpoint-00000002")
    metrics, options = sent[0]
    assert "shoal_profiles" not in metrics and metrics["checkpointed"] is True
    assert options["checkpoint"] is checkpoint and options["checkpoint_dir_name"] == "checkpoint-00000002"
    assert len(reporter.profiles) == 1


def test_the_loop_s_records_from_a_checkpoint_are_sent_again(sent: list) -> None:
    """The loop puts a restored checkpoint's recent records back into the buffers as plain data."""
    reporter = Reporter(StepStats(world_size=1, interval_s=1e9, rank=0))
    recent = json.loads(
        json.dumps(
            {
                "steps": [StepRecord(5, 1.0, {"train/loss": 1.0}).to_dict()],
                "evals": [Event(EventKind.EVAL, 2.0, {"step": 5, "val/loss": 0.9}).to_dict()],
            }
        )
    )
    reporter.steps = [*recent["steps"], *reporter.steps]
    reporter.events += recent["evals"]
    reporter.send(_summary(5))
    report = WorkerReport.from_metrics(sent[0][0])
    assert [s.step for s in report.steps] == [5] and report.events[0].fields == {"step": 5, "val/loss": 0.9}


def test_an_unknown_event_kind_fails_in_the_worker() -> None:
    with pytest.raises(ValueError):
        Reporter(StepStats(world_size=1, interval_s=1e9, rank=0)).event("nan_explode")
