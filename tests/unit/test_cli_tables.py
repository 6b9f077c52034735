"""Every table the CLI prints stays readable at 80 columns (what rich assumes when the
output is piped), and `--format json` gives the same rows. No Ray: runs live in an
MLflow sqlite file, jobs, checks and results are plain data."""

from __future__ import annotations

import json
import time
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from rich.console import Console

from shoal import cli, cli_runs
from shoal.cli_inspect import doctor_table, plan_data, plan_tables
from shoal.launch.progress import EVENT_LINES, summary_table
from shoal.launch.sweep_view import SweepTable, summary
from shoal.messages import EventKind

NAMES = ("quickstart-20261203-101500", "gpt-small-fsdp-20261203-102233", "cnn-digits-20261203-110000")
STATUSES = ("FINISHED", "FAILED", "RUNNING")
LONG_PARAM = "x" * 150


def render(renderable, width: int = 80) -> str:
    console = Console(width=width, file=StringIO())
    console.print(renderable)
    return console.file.getvalue()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Three shoal runs with metrics, params and events, in a sqlite MLflow store."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("digits", artifact_location=str(root / "artifacts"))
    ids = []
    for i, (name, status) in enumerate(zip(NAMES, STATUSES, strict=True)):
        run_id = client.create_run(experiment, run_name=name, tags={"shoal.run_name": name}).info.run_id
        now = int(time.time() * 1000)
        losses = [Metric("train/loss", 1 / step + i, now, step) for step in range(1, 41)]  # ends at i.025
        finals = [Metric("val/loss", 0.5 + i, now, 40), Metric("val/accuracy", 0.9 + i / 100, now, 40)]
        client.log_batch(run_id, metrics=losses + finals)
        client.log_param(run_id, "train.optimizer.lr", str(0.001 * (i + 1)))
        client.log_param(run_id, "note", LONG_PARAM)
        events = [
            {"kind": "attempt_started", "time": time.time(), "world_size": 2, "device": "cpu"},
            {"kind": "straggler", "time": time.time(), "rank": 1, "ratio": 2.5},
        ]
        client.log_dict(run_id, events, "events.json")
        if status != "RUNNING":
            client.set_terminated(run_id, status)
        ids.append(run_id)
    return SimpleNamespace(uri=uri, ids=ids)


def unfolded(text: str) -> str:
    """The text without borders, spaces and line breaks: folded cells read whole again."""
    return "".join(ch for ch in text if not ch.isspace() and ch not in "│┃")


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    """`shoal ARGV` in this process, printed at 80 columns."""
    console = Console(width=80, file=StringIO())
    monkeypatch.setattr(cli, "console", console)
    assert cli.main(list(argv)) == 0
    return console.file.getvalue()


def run_json(capsys: pytest.CaptureFixture, *argv: str):
    assert cli.main([*argv, "--format", "json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out)  # stdout holds the JSON and nothing else


def test_runs_list_at_80_columns_keeps_name_status_and_a_metric(store, monkeypatch) -> None:
    text = run_cli(monkeypatch, "runs", "list", "--tracking-uri", store.uri)
    for run_id, status in zip(store.ids, STATUSES, strict=True):
        assert run_id in text and status in text  # ids whole: people copy them
    for name in NAMES:
        assert name[:12] in text  # long names fold onto a second line
    assert "0.025" in text and "loss" in text  # the first run's last train/loss
    assert "left out at 80 columns" in text and "--format json" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_runs_list_shows_every_column_when_wide(store) -> None:
    rows = cli_runs.list_data(store.uri, None, 50)
    text = render(cli_runs.list_table(rows, store.uri), width=200)
    for header in ("experiment", "started", "val loss", "val acc", "samples/s", "MFU"):
        assert header in text
    assert "left out" not in text and all(name in text for name in NAMES)


def test_runs_list_json_holds_the_same_rows(store, capsys) -> None:
    rows = run_json(capsys, "runs", "list", "--tracking-uri", store.uri)
    assert rows == cli_runs.list_data(store.uri, None, 50)
    assert [r["name"] for r in rows] == list(reversed(NAMES))  # newest first
    first = next(r for r in rows if r["name"] == NAMES[0])
    assert first["status"] == "FINISHED" and first["step"] == 40
    assert first["metrics"]["train/loss"] == pytest.approx(0.025) and first["metrics"]["val/loss"] == 0.5


def test_runs_show_at_80_columns(store, monkeypatch) -> None:
    text = run_cli(monkeypatch, "runs", "show", NAMES[1], "--tracking-uri", store.uri)
    for field in (NAMES[1], store.ids[1], "FAILED", "train/loss", "1.025", "attempt_started", "straggler"):
        assert field in text, field
    assert "train.optimizer.lr" in text and "0.002" in text
    assert LONG_PARAM in unfolded(text)  # a long value folds, it is not cut
    assert max(len(line) for line in text.splitlines()) <= 80


def test_runs_show_json(store, capsys) -> None:
    shown = run_json(capsys, "runs", "show", store.ids[1], "--tracking-uri", store.uri)
    assert shown["name"] == NAMES[1] and shown["status"] == "FAILED" and shown["steps"] == 40
    assert shown["metrics"]["val/accuracy"] == pytest.approx(0.91)
    assert shown["params"] == {"note": LONG_PARAM, "train.optimizer.lr": "0.002"}
    assert [e["kind"] for e in shown["events"]] == ["attempt_started", "straggler"]
    assert shown["attempts"][0]["world_size"] == 2 and shown["attempts"][0]["device"] == "cpu"


def test_runs_compare_at_80_columns(store, monkeypatch) -> None:
    text = run_cli(monkeypatch, "runs", "compare", *NAMES, "--tracking-uri", store.uri)
    for name, status in zip(NAMES, STATUSES, strict=True):
        assert name[:12] in text and status in text
    assert "train.optimizer.lr" in text and "0.003" in text and "val/accuracy" in text and "0.92" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_runs_compare_splits_runs_that_do_not_fit(store) -> None:
    runs = cli_runs.compare_data(store.uri, [*NAMES, *NAMES])
    tables = cli_runs.compare_tables(runs, 80)
    assert len(tables) == 2 and all(t.columns[0].header == "" for t in tables)
    assert sum(len(t.columns) - 1 for t in tables) == 6


def test_runs_compare_json(store, capsys) -> None:
    runs = run_json(capsys, "runs", "compare", *NAMES, "--tracking-uri", store.uri)
    assert [r["name"] for r in runs] == list(NAMES) and [r["status"] for r in runs] == list(STATUSES)
    assert [r["params"] for r in runs] == [{"train.optimizer.lr": f"0.00{i}"} for i in (1, 2, 3)]
    assert runs[2]["metrics"]["val/loss"] == 2.5


def test_jobs_table_and_json() -> None:
    rows = [
        {
            "job_id": f"raysubmit_{i}AbCdEfGhIjKlMn",
            "status": "SUCCEEDED",
            "run_name": f"quickstart-2026120{i}-101500",
            "mlflow_run_id": "0123456789abcdef0123456789abcdef",
            "entrypoint": "python -m shoal.cli run quickstart.yaml --run-name x " + "--set a=b " * 20,
            "start_time": 1764756000000,
            "end_time": None,
        }
        for i in range(2)
    ]
    text = render(cli.jobs_table(rows, "http://127.0.0.1:8265"))
    assert "raysubmit_0AbCdEfGhIjKlMn" in text and "SUCCEEDED" in text and "quickstart-" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    converted = json.loads(json.dumps(cli.jobs_json(rows)))
    assert converted[0]["start_time"].startswith("2025-12-03T") and converted[0]["end_time"] is None
    assert converted[1]["entrypoint"] == rows[1]["entrypoint"]


def _plan():
    from shoal.plan.planner import make_plan
    from shoal.spec.schema import Workload

    workload = Workload.model_validate(
        {
            "name": "big",
            "model": {"family": "gpt", "args": {"n_layers": 4, "d_model": 256, "n_heads": 4, "seq_len": 128}},
            "data": {"builtin": "pytext", "batch_size": 8},
            "train": {"max_steps": 10, "global_batch_size": 64, "precision": "bf16"},
        }
    )
    return plan_data(make_plan(workload, "h100-80gb", 8, 1, None), workload)


def test_plan_tables_at_80_columns_and_json() -> None:
    data = _plan()
    main_table, by_precision = plan_tables(data)
    text = render(main_table)
    choice = data["recommended"]
    assert choice["strategy"] in text and "peak" in text and "yes" in text
    assert f"{choice['bytes_per_gpu']['peak'] / 1e6:.3g} MB" in text
    assert "left out at 80 columns" in text and max(len(line) for line in text.splitlines()) <= 80
    assert "fp32" in render(by_precision) and "bf16" in render(by_precision)
    assert json.loads(json.dumps(data))["options"][0]["layout"] == data["options"][0]["layout"]


def test_plan_command_json_is_alone_on_stdout(tmp_path: Path, capsys) -> None:
    source = tmp_path / "w.yaml"
    source.write_text("name: w\nmodel: {family: mlp}\ndata: {builtin: digits}\ntrain: {max_steps: 1}\n")
    data = run_json(capsys, "plan", str(source), "--gpu", "h100-80gb", "--gpus", "2")
    assert data["gpus"] == 2 and data["recommended"]["fits"] and len(data["by_precision"]) == 3


def test_doctor_table_at_80_columns() -> None:
    checks = [
        {"check": "python", "status": "ok", "found": "3.11.7", "hint": ""},
        {"check": "cuda", "status": "not applicable", "found": "no CUDA GPU " * 5, "hint": "use CPU " * 8},
        {"check": "ray", "status": "failed", "found": "no Ray cluster at 127.0.0.1:1", "hint": "start one"},
    ]
    text = render(doctor_table(checks))
    assert all(c["check"] in text for c in checks) and "✗" in text and "no Ray cluster at" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_run_summary_at_80_columns() -> None:
    result = SimpleNamespace(
        status="FINISHED",
        run_name=NAMES[0],
        step=200,
        total_steps=200,
        metrics={"train/loss": 0.1234, "val/accuracy": 0.9731},
        resumed_from=None,
        restarts=0,
        unsent_writes=0,
        reason=None,
        checkpoint="/very/long/" + "path/" * 20 + "checkpoint-00000200",
        run_dir="/tmp/shoal_runs/" + NAMES[0],
        experiment="quickstart",
        run_id="0123456789abcdef0123456789abcdef",
        tracking_uri="sqlite:////tmp/mlflow.db",
        model_uri="models:/a-registered-model-with-a-long-name@production",
        model_error=None,
    )
    text = render(summary_table(result))
    assert NAMES[0] in text and "FINISHED" in text and "0.9731" in text
    assert result.model_uri in unfolded(text)
    assert result.checkpoint in unfolded(text)  # folded onto more lines, never cut
    assert "0123456789abcdef0123456789abcdef" in text and max(len(line) for line in text.splitlines()) <= 80


def test_a_failure_reason_with_brackets_is_shown_as_text() -> None:
    """gloo's errors quote their source as '[/__w/.../pair.cc:152]': rich took it for markup
    and the driver died printing its own summary (MarkupError)."""
    reason = "Connection closed by peer [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:1]"
    result = SimpleNamespace(
        status="FAILED", run_name="r", step=3, total_steps=9, metrics={}, resumed_from=None, restarts=1,
        unsent_writes=0, reason=reason, checkpoint="/runs/[x]/checkpoint-00000002", run_dir="/runs/[x]",
        experiment="[e]", run_id="0" * 32, tracking_uri="sqlite:////tmp/[m].db", model_uri=None,
        model_error=None,
    )  # fmt: skip
    text = unfolded(render(summary_table(result)))
    assert "[/__w/pytorch/pytorch/third_party/gloo" in text and "/runs/[x]" in text and "[e]" in text


@pytest.mark.parametrize("kind", [EventKind.FAILURE, EventKind.FATAL])
def test_a_failure_event_with_brackets_is_printed_as_text(kind: EventKind) -> None:
    """The same gloo text in a failure or fatal event: the driver's report thread died printing
    it ('could not record a report in MLflow'), so the run's records stopped there."""
    error = "Connection closed by peer [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]"
    fields = {"errors": {"0": error}} if kind == EventKind.FAILURE else {"reason": error}
    text = unfolded(render(EVENT_LINES[kind](fields)))
    assert "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]" in text


def test_a_skipped_checkpoint_is_one_line_naming_both_steps() -> None:
    text = render(EVENT_LINES[EventKind.CHECKPOINT_SKIPPED]({"step": 40, "writing_step": 20}), width=200)
    assert text.strip() == (
        "checkpoint skipped at step 40: the one of step 20 is still being written (checkpoint.if_busy: skip)"
    )


def _sweep_table(paths: list[str]) -> SweepTable:
    table = SweepTable.__new__(SweepTable)  # the table alone, without its live display
    table.paths, table.metric, table.mode, table.rows = paths, "val/accuracy", "max", {}
    for i in range(3):
        trial = SimpleNamespace(trial_id=f"4a2b1_0000{i}", config={p: 0.001 * (i + 1) for p in paths})
        row = table._row(trial)
        row.update(status="RUNNING", step=120, metric=0.91 + i / 100)
    return table


@pytest.mark.parametrize("params", [2, 4])
def test_sweep_table_at_80_columns(params: int) -> None:
    paths = ["train.optimizer.lr", "train.optimizer.weight_decay", "model.args.d_model", "data.seed"]
    text = render(_sweep_table(paths[:params])._table())
    assert "RUNNING" in text and "0.93 *" in text and "0.003" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    if params == 2:
        assert "4a2b1_00002" in text and "left out" not in text
    else:
        assert "left out at 80 columns: trial" in text  # the parameters matter more


def test_sweep_summary_at_80_columns() -> None:
    best = SimpleNamespace(trial_id="4a2b1_00002", metric=0.93, params={"train.optimizer.lr": 0.003})
    result = SimpleNamespace(
        name="quickstart-sweep-20261203-101500",
        trials=[SimpleNamespace(status="FINISHED"), SimpleNamespace(status="FINISHED")],
        metric="val/accuracy",
        best=best,
        best_file="/tmp/sweeps/" + "long/" * 15 + "best.yaml",
        placement_groups_left=0,
        directory="/tmp/sweeps/quickstart-sweep",
        experiment="quickstart",
        parent_run_id="0123456789abcdef0123456789abcdef",
    )
    text = render(summary(result))
    assert "2 finished" in text and "0.93" in text and "4a2b1_00002" in text
    assert result.best_file in unfolded(text)
    assert max(len(line) for line in text.splitlines()) <= 80
