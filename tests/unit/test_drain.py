"""The driver's Drainer against an in-process queue (no Ray): every message reaches the
Recorder in order, a stop message ends it, nothing queued before the stop is lost."""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any

import pytest

from shoal.launch.interrupts import Interrupted, fit_interruptibly
from shoal.messages import Event, EventKind, ReportSummary, StepRecord
from shoal.queue_messages import ControllerMessage, FailureMessage, QueueMessage, ReportMessage
from shoal.tracking import drain
from shoal.tracking.drain import Drainer


class ListQueue(queue.Queue):
    """`queue.Queue` with the two calls of `ray.util.queue.Queue` that it lacks."""

    def size(self) -> int:
        return self.qsize()

    def get_nowait_batch(self, num_items: int) -> list[Any]:
        return [self.get_nowait() for _ in range(num_items)]


class FakeRun:
    def __init__(self) -> None:
        self.flushes = 0

    def flush(self) -> bool:
        self.flushes += 1
        return True


class FakeRecorder:
    def __init__(self, fail_on_step: int | None = None) -> None:
        self.run, self.handled, self.fail_on_step = FakeRun(), [], fail_on_step

    def handle(self, message: QueueMessage) -> None:
        if isinstance(message, ReportMessage) and message.summary.step == self.fail_on_step:
            raise RuntimeError("MLflow said no")
        self.handled.append(message)


class FakeKeeper:
    def __init__(self) -> None:
        self.offers: list[tuple[str, int, float | None]] = []

    def offer(self, checkpoint_path: str, step: int, score: float | None) -> bool:
        self.offers.append((checkpoint_path, step, score))
        return True


def _report(step: int, checkpoint: str | None = None, score: float | None = None) -> ReportMessage:
    summary = ReportSummary(step, 0, 8 * step, 2, 10, score=score, checkpointed=checkpoint is not None)
    return ReportMessage(summary, [StepRecord(step, 1.0, {"train/loss": 1.0})], [], checkpoint)


def test_every_message_reaches_the_recorder_in_order_and_checkpoints_the_keeper() -> None:
    reports, recorder, keeper = ListQueue(), FakeRecorder(), FakeKeeper()
    drainer = Drainer(reports, recorder, keeper)  # type: ignore[arg-type]
    drainer.start()
    sent = [
        _report(1),
        FailureMessage({0: "ActorDiedError"}, 2.0),
        _report(2, "/runs/a/checkpoint-00000002", score=0.5),
        ReportMessage(_report(3).summary, [], [Event(EventKind.FATAL, 3.0, {"reason": "NaN"})]),
    ]
    for message in sent:
        reports.put(message.to_dict())
    drainer.finish()
    assert not drainer.is_alive() and drainer.errors == 0
    assert recorder.handled == sent  # the stop message itself is not recorded
    assert keeper.offers == [("/runs/a/checkpoint-00000002", 2, 0.5)]
    assert reports.empty()


def test_messages_queued_behind_the_stop_are_drained_by_finish() -> None:
    reports, recorder = ListQueue(), FakeRecorder()
    drainer = Drainer(reports, recorder)  # type: ignore[arg-type]
    drainer.stopping.set()  # the thread ends at once, as if finish() had woken it
    drainer.start()
    drainer.join()
    reports.put(_report(1).to_dict())
    reports.put(_report(2).to_dict())
    drainer.finish()
    assert [m.summary.step for m in recorder.handled] == [1, 2]


def test_tracking_trouble_is_counted_and_draining_goes_on() -> None:
    reports, recorder = ListQueue(), FakeRecorder(fail_on_step=1)
    drainer = Drainer(reports, recorder)  # type: ignore[arg-type]
    drainer.start()
    reports.put(_report(1).to_dict())  # the recorder fails on this one
    reports.put({"type": "report", "summary": {"step": 2}})  # not a whole message
    reports.put(_report(3).to_dict())
    drainer.finish()
    assert drainer.errors == 2 and [m.summary.step for m in recorder.handled] == [3]


def test_an_idle_queue_retries_buffered_mlflow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "RETRY_EVERY_S", 0.01)
    reports, recorder = ListQueue(), FakeRecorder()
    drainer = Drainer(reports, recorder)  # type: ignore[arg-type]
    drainer.start()
    while recorder.run.flushes < 3:
        drainer.join(timeout=0.01)
    drainer.finish()
    assert recorder.handled == []


class GoneQueue(ListQueue):
    """A queue whose actor died with the cluster (a cancelled Slurm job stops Ray)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        raise ConnectionError("The actor is unavailable: RPC error: Socket closed\nmore detail")

    size = get  # type: ignore[assignment]


def test_a_queue_gone_with_the_cluster_is_one_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    drainer = Drainer(GoneQueue(), FakeRecorder())  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="shoal"):
        drainer.start()
        drainer.finish()
    gone = "ConnectionError: The actor is unavailable: RPC error: Socket closed"  # its first line
    assert [r.getMessage() for r in caplog.records] == [
        f"lost the report queue: {gone}",
        f"could not drain the last reports: {gone}",
    ]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_sigterm_while_training_is_named_as_the_reason() -> None:
    class SignalledTrainer:
        def fit(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # as scancel or `kill` would
            time.sleep(10)

    before = signal.getsignal(signal.SIGTERM)  # Python's default, or Ray's where Ray started here
    with pytest.raises(Interrupted) as caught:
        fit_interruptibly(SignalledTrainer())
    assert caught.value.reason == "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was put back


class Controller:
    """Stands for the TrainController's actor handle."""

    class abort:  # noqa: N801 - an actor method: `handle.abort.remote()`
        @staticmethod
        def remote() -> str:
            return "abort-ref"


def test_the_controllers_handle_is_kept_for_a_stop_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[tuple[Any, float]] = []
    monkeypatch.setattr("ray.get", lambda ref, timeout: waited.append((ref, timeout)))
    reports, recorder = ListQueue(), FakeRecorder()
    drainer = Drainer(reports, recorder)  # type: ignore[arg-type]
    drainer.stop_training()  # before the first report there is nothing to abort
    drainer.start()
    reports.put(ControllerMessage(Controller()).to_dict())
    reports.put(_report(1).to_dict())
    drainer.finish()
    assert isinstance(drainer.controller, Controller) and [m.summary.step for m in recorder.handled] == [1]
    drainer.stop_training()
    drainer.stop_training()  # once aborted, never again
    assert waited == [("abort-ref", drain.ABORT_TIMEOUT_S)]


def test_a_controller_that_does_not_abort_in_time_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    def too_late(ref: Any, timeout: float) -> None:
        raise ray.exceptions.GetTimeoutError("no answer")

    monkeypatch.setattr("ray.get", too_late)
    drainer = Drainer(ListQueue(), FakeRecorder())  # type: ignore[arg-type]
    drainer.controller = type(
        "Controller", (), {"abort": type("abort", (), {"remote": staticmethod(lambda: 1)})}
    )
    drainer.stop_training()
    assert "did not abort in 10 s: workers may train on" in caplog.text
