"""The driver's MLflow side, against a real sqlite tracking store (no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from shoal.messages import Event, EventKind, Metric, ReportSummary, StepRecord
from shoal.queue_messages import FailureMessage, ReportMessage
from shoal.tracking import Recorder, open_run, resolve_uri
from shoal.tracking.mlflow_run import flatten


def _open(tmp_path: Path, resume: bool, run_dir: str = "/runs/a"):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = {"name": "w", "train": {"optimizer": {"lr": 0.1}, "betas": [0.9, 0.99]}}
    return open_run(uri, "exp", "job-1", run_dir, resume, spec, "name: w\n", {"shoal.workload": "w"})


def _report(
    steps: range, events: list[Event] | None = None, checkpoint: str | None = None, **summary
) -> ReportMessage:
    records = [StepRecord(s, None, {Metric.TRAIN_LOSS: 1.0 / s, Metric.TRAIN_LR: 0.1}) for s in steps]
    step = steps[-1] if steps else 0
    fields = {"step": step, "epoch": 0, "samples": 8 * step, "total_steps": 20, "world_size": 2, **summary}
    return ReportMessage(ReportSummary(**fields), records, events or [], checkpoint)


def _eval(step: int, loss: float) -> Event:
    return Event(EventKind.EVAL, 0, {"step": step, Metric.VAL_LOSS: loss})


def test_flatten_params() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": {}}) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "d": "None",
        "e": "{}",
    }


def test_default_uri_is_an_absolute_sqlite_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_uri(None) == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_uri(None) == "http://127.0.0.1:5000"
    assert resolve_uri("sqlite:///x.db") == f"sqlite:///{tmp_path}/x.db"  # the spec wins


def test_replayed_steps_are_logged_once(tmp_path: Path) -> None:
    run = _open(tmp_path, resume=False)
    recorder = Recorder(run)
    started = Event(EventKind.ATTEMPT_STARTED, 0, {"world_size": 2, "restored_step": None})
    recorder.handle(_report(range(1, 11), [started]))
    recorder.handle(FailureMessage({1: "ActorDiedError: killed"}, 1.0))
    restarted = Event(EventKind.ATTEMPT_STARTED, 0, {**started.fields, "restored_step": 6})
    recorder.handle(_report(range(7, 16), [restarted], checkpoint="/runs/a/checkpoint-15"))
    recorder.finish("FINISHED")

    client = MlflowClient(run.uri)
    history = client.get_metric_history(run.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 16))
    stored = client.get_run(run.run_id)
    assert stored.info.status == "FINISHED"
    assert stored.data.tags["shoal.restarts"] == "1"
    assert stored.data.tags["shoal.latest_checkpoint"] == "/runs/a/checkpoint-15"
    assert stored.data.params["train.optimizer.lr"] == "0.1"
    events = json.loads(Path(client.download_artifacts(run.run_id, "events.json", str(tmp_path))).read_text())
    assert [e["kind"] for e in events] == ["attempt_started", "failure", "attempt_started"]
    assert events[1]["errors"] == {"1": "ActorDiedError: killed"} and events[2]["restored_step"] == 6
    assert [e.kind for e in recorder.state.events] == [
        EventKind.ATTEMPT_STARTED,
        EventKind.FAILURE,
        EventKind.ATTEMPT_STARTED,
    ]


def test_resume_reopens_the_same_run_without_duplicates(tmp_path: Path) -> None:
    first = _open(tmp_path, resume=False)
    recorder = Recorder(first)
    recorder.handle(_report(range(1, 9), [_eval(8, 0.5)]))
    recorder.finish("KILLED")

    again = _open(tmp_path, resume=True)
    assert again.run_id == first.run_id and again.resumed and again.logged_until == 8
    recorder = Recorder(again)
    recorder.handle(_report(range(5, 13), [_eval(8, 0.4)]))
    recorder.finish("FINISHED")
    client = MlflowClient(again.uri)
    assert sorted(m.step for m in client.get_metric_history(again.run_id, "train/loss")) == list(range(1, 13))
    assert [m.value for m in client.get_metric_history(again.run_id, "val/loss")] == [0.5]
    assert client.get_run(again.run_id).info.status == "FINISHED"
    assert [e.kind for e in recorder.state.events] == [EventKind.JOB_RESUMED]  # evals are metrics


def test_a_fresh_run_dir_gets_a_fresh_mlflow_run(tmp_path: Path) -> None:
    first = _open(tmp_path, resume=False)
    Recorder(first).finish("FINISHED")
    assert _open(tmp_path, resume=False).run_id != first.run_id  # checkpoints gone: start afresh
    assert _open(tmp_path, resume=True, run_dir="/runs/other").run_id != first.run_id


@pytest.mark.parametrize("left", ["RUNNING", "FAILED", "KILLED"])
def test_a_run_left_without_a_checkpoint_is_taken_over_by_the_next_driver(tmp_path: Path, left: str) -> None:
    """The driver died (or failed, or was stopped) before its first checkpoint: the same
    command again continues that MLflow run from step 0, no step logged twice, and it ends
    FINISHED instead of staying RUNNING for ever."""
    first = _open(tmp_path, resume=False)
    recorder = Recorder(first)
    recorder.handle(_report(range(1, 7), [_eval(5, 0.5)]))
    if left != "RUNNING":  # RUNNING: a SIGKILLed driver, no handler ran
        recorder.finish(left)

    again = _open(tmp_path, resume=False)
    assert again.run_id == first.run_id and again.taken_over_from == left and again.logged_until == 6
    recorder = Recorder(again)
    recorder.handle(_report(range(1, 11), [_eval(5, 0.5), _eval(10, 0.3)]))  # trained from step 0
    recorder.finish("FINISHED")
    client = MlflowClient(again.uri)
    steps = [m.step for m in client.get_metric_history(again.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 11))  # each step once
    assert [m.step for m in client.get_metric_history(again.run_id, "val/loss")] == [5, 10]
    run = client.get_run(again.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["shoal.taken_over_from"] == left
    assert len(client.search_runs([run.info.experiment_id])) == 1


class _ReadsBackOnEachCall:
    """A sweep's observer: Tune may end the trial the moment it hears, so what it hears of
    must already be in MLflow."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client, self.run_id, self.seen = client, run_id, []

    def _stored(self, name: str) -> None:
        losses = self.client.get_metric_history(self.run_id, "train/loss")
        tags = self.client.get_run(self.run_id).data.tags
        self.seen.append((name, sorted(m.step for m in losses), tags.get("shoal.latest_checkpoint")))

    def on_progress(self, step: int, total: int, metrics: dict[str, float]) -> None:
        self._stored("progress")

    def on_event(self, event: Event) -> None:
        self._stored(event.kind.value)

    def on_checkpoint(self, path: str, step: int) -> None:
        self._stored("checkpoint")


def test_the_observer_hears_of_a_report_only_once_it_is_written(tmp_path: Path) -> None:
    run = _open(tmp_path, resume=False)
    observer = _ReadsBackOnEachCall(MlflowClient(run.uri), run.run_id)
    recorder = Recorder(run, observer=observer)
    recorder.handle(_report(range(1, 6), [_eval(5, 0.5)], checkpoint="/runs/a/checkpoint-5"))
    written = (list(range(1, 6)), "/runs/a/checkpoint-5")
    assert observer.seen == [("eval", *written), ("checkpoint", *written), ("progress", *written)]
    recorder.finish("FINISHED")


def test_a_write_that_raises_leaves_no_observer_call_for_the_next_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _open(tmp_path, resume=False)
    observer = _ReadsBackOnEachCall(MlflowClient(run.uri), run.run_id)
    recorder = Recorder(run, observer=observer)
    set_tags = run.set_tags

    def broken(tags: dict) -> None:
        raise RuntimeError("a bug in a write")

    monkeypatch.setattr(run, "set_tags", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        recorder.handle(_report(range(1, 6), [_eval(5, 0.5)], checkpoint="/runs/a/checkpoint-5"))
    assert [name for name, *_ in observer.seen] == ["eval"]  # written before the raise; the checkpoint not
    monkeypatch.setattr(run, "set_tags", set_tags)
    observer.seen.clear()
    recorder.handle(_report(range(6, 8)))
    assert observer.seen == [("progress", list(range(1, 8)), None)]
    recorder.finish("FINISHED")


def test_drivers_starting_together_on_a_new_sqlite_store_all_get_their_run(tmp_path: Path) -> None:
    """Six processes at once on a store that does not exist yet (a submission storm): without
    the lock they ran MLflow's schema migration together and most failed ('table
    _alembic_tmp_tags already exists'); each must get its run, in one experiment."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = (
        "from shoal.tracking.mlflow_run import experiment_id_of, tracking_client; "
        f"c = tracking_client({uri!r}); print(c.create_run(experiment_id_of(c, 'storm')).info.run_id)"
    )
    drivers = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    results = [(d.communicate(timeout=120), d.returncode) for d in drivers]
    assert all(rc == 0 for _, rc in results), [err[-500:] for (_, err), rc in results if rc]
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "storm"]
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(out.strip() for (out, _), _ in results)
