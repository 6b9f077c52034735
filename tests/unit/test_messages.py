"""The worker<->driver message format (shoal/messages.py): every message survives the trip to
plain data and back, through JSON (as in checkpoints and events.json) and as Ray carries it."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from shoal.messages import (
    Event,
    EventKind,
    GpuReading,
    LoopOutcome,
    Metric,
    ProfileTrace,
    RecentRecords,
    ReportSummary,
    StepRecord,
    WorkerReport,
    WorkerValue,
    eval_metrics,
    gpu_metric,
    worker_metric,
)
from shoal.queue_messages import FailureMessage, ReportMessage, StopMessage, message_from_dict


def _through_json(data: Any) -> Any:
    return json.loads(json.dumps(data))


def _plain_keys(data: Any) -> bool:
    """No enum (of shoal's) anywhere in plain data: it must not need shoal to be read."""
    if isinstance(data, dict):
        return all(type(k) is str and _plain_keys(v) for k, v in data.items())
    if isinstance(data, list):
        return all(_plain_keys(item) for item in data)
    return type(data) in (str, int, float, bool, type(None))


def _step(step: int) -> StepRecord:
    values = {Metric.TRAIN_LOSS: 2.0 / step, Metric.TRAIN_LR: 0.1, worker_metric(0, WorkerValue.BUSY_S): 0.2}
    return StepRecord(step, 1000.0 + step, values)


def _summary(**extra: Any) -> ReportSummary:
    return ReportSummary(step=4, epoch=1, samples=64, world_size=2, total_steps=10, **extra)


def _trace(rank: int, **where: str) -> ProfileTrace:
    return ProfileTrace(rank, f"rank{rank}.steps3-4.pt.trace.json.gz", 3, 4, **where)


def test_the_module_needs_neither_torch_nor_ray() -> None:
    import subprocess

    imports = "import sys, shoal.messages, shoal.queue_messages"
    code = f"{imports}; sys.exit(bool({{'torch', 'ray'}} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_step_records_and_events_round_trip_through_json() -> None:
    record = _step(3)
    plain = record.to_dict()
    assert plain["step"] == 3 and plain["train/loss"] == pytest.approx(2 / 3) and _plain_keys(plain)
    assert StepRecord.from_dict(_through_json(plain)) == record
    assert StepRecord.from_dict({"step": 5, "train/loss": 1.0}) == StepRecord(5, None, {"train/loss": 1.0})

    event = Event(EventKind.STRAGGLER, 12.5, {"rank": 1, "step": 7, "busy_s": 0.3})
    assert event.to_dict() == {"kind": "straggler", "time": 12.5, "rank": 1, "step": 7, "busy_s": 0.3}
    assert Event.from_dict(_through_json(event.to_dict())) == event
    assert Event("eval", 1.0).kind is EventKind.EVAL  # a kind's plain value is accepted
    assert event.get("rank") == 1 and event.get("missing", "-") == "-"


def test_events_refuse_unknown_kinds_and_clashing_fields() -> None:
    with pytest.raises(ValueError):
        Event("nan_explode", 0.0)
    with pytest.raises(ValueError, match="kind or time"):
        Event(EventKind.FATAL, 0.0, {"time": 1.0})


def test_enums_name_what_the_code_used_as_strings() -> None:
    assert EventKind.for_nan_policy("skip") is EventKind.NAN_SKIP
    assert EventKind.for_nan_policy("rollback") is EventKind.NAN_ROLLBACK
    assert {str(o) for o in LoopOutcome} == {"done", "fatal", "rollback", "skip", "exhausted"}
    assert LoopOutcome.ROLLBACK == "rollback"  # compares with the loop's strings
    assert gpu_metric(1, GpuReading.POWER_W) == "gpu/1/power_w"
    assert worker_metric(0, WorkerValue.BUSY_S) == "worker/0/busy_s"
    assert eval_metrics({"step": 4, "val/loss": 0.5, "train/loss": 0.7}) == {"val/loss": 0.5}


def test_a_summary_refuses_unknown_keys() -> None:
    summary = _summary(final=True, score=0.25)
    assert ReportSummary.from_dict(_through_json(summary.to_dict())) == summary
    assert ReportSummary.coerce(summary.to_dict()) == summary and ReportSummary.coerce(summary) is summary
    with pytest.raises(TypeError):
        ReportSummary.from_dict({**summary.to_dict(), "stpe": 3})


def test_a_worker_report_is_plain_metrics_for_ray_train() -> None:
    event = Event(EventKind.EVAL, 5.0, {"step": 4, Metric.VAL_LOSS: 0.5})
    report = WorkerReport(
        _summary(checkpointed=True), [_step(3), _step(4)], [event], [_trace(0, data="eA==")]
    )
    metrics = report.to_metrics()
    assert metrics["step"] == 4 and metrics["checkpointed"] is True and len(metrics["shoal_steps"]) == 2
    assert _plain_keys(metrics)  # Ray keeps a checkpoint report's metrics as JSON
    assert WorkerReport.from_metrics(_through_json(metrics)) == report
    assert "shoal_profiles" not in WorkerReport(_summary()).to_metrics()  # only when there are some


def test_a_report_message_takes_rank_zeros_records_and_every_ranks_profiles() -> None:
    lead = WorkerReport(
        _summary(), [_step(4)], [Event(EventKind.FATAL, 3.0, {"reason": "x"})], [_trace(0, data="QQ==")]
    )
    other = WorkerReport(_summary(), [_step(4)], [], [_trace(1, path="/node/b/rank1.gz")])
    message = ReportMessage.from_ranks([lead.to_metrics(), other.to_metrics()], "/runs/a/checkpoint-00000004")
    assert message.summary == lead.summary and message.steps == lead.steps and message.events == lead.events
    assert [t.rank for t in message.profiles] == [0, 1] and message.checkpoint.endswith("00000004")
    plain = message.to_dict()
    assert plain["type"] == "report" and _plain_keys(plain)
    assert message_from_dict(_through_json(plain)) == message


def test_failure_and_stop_messages_round_trip() -> None:
    failure = FailureMessage({1: "ActorDiedError: killed"}, 7.0)
    back = message_from_dict(_through_json(failure.to_dict()))
    assert back == failure and list(back.errors) == [1]  # JSON made the rank a string
    assert failure.event() == Event(EventKind.FAILURE, 7.0, {"errors": {1: "ActorDiedError: killed"}})
    assert StopMessage().to_dict() == {"type": "shoal.stop"}
    assert isinstance(message_from_dict({"type": "shoal.stop"}), StopMessage)
    with pytest.raises(ValueError):
        message_from_dict({"type": "gossip"})


def test_a_profile_trace_travels_with_data_or_a_path() -> None:
    small, big = _trace(0, data="QQ=="), _trace(2, path="/node/c/rank2.gz")
    assert "path" not in small.to_dict() and "data" not in big.to_dict()
    assert ProfileTrace.from_dict(_through_json(small.to_dict())) == small
    event = small.event(at=9.0)
    assert event.kind is EventKind.PROFILE and "data" not in event.fields
    assert event.fields == {"rank": 0, "name": small.name, "first_step": 3, "last_step": 4}


def test_recent_records_round_trip_as_a_checkpoint_keeps_them() -> None:
    recent = RecentRecords([_step(1), _step(2)], [Event(EventKind.EVAL, 2.0, {"step": 2, "val/loss": 0.4})])
    plain = recent.to_dict()
    assert set(plain) == {"steps", "evals"} and _plain_keys(plain)
    assert RecentRecords.from_dict(_through_json(plain)) == recent
