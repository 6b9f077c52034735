"""Real faults on the shared cluster: a SIGKILLed worker, Ctrl-C and a resumed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from shoal.launch import RunResult
from tests.conftest import WORKLOADS, quickstart
from tests.integration.conftest import run_workload


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def registered(run_dir: Path, checkpoint: str) -> bool:
    """Ray Train has committed this checkpoint (its directory appears before that)."""
    try:
        return checkpoint in (run_dir / "checkpoint_manager_snapshot.json").read_text()
    except OSError:
        return False


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))


def sigkill_worker_mid_run(
    workdir: Path, overrides: list[str], run_name: str, after_checkpoint: str, rank: int
) -> tuple[RunResult, int]:
    """Run the quickstart in a thread, SIGKILL `rank` once `after_checkpoint` is committed."""
    outcome: dict[str, RunResult] = {}
    runner = threading.Thread(
        target=lambda: outcome.update(result=run_workload(workdir, quickstart(), overrides, run_name))
    )
    runner.start()
    run_dir = workdir / "shoal_runs" / run_name
    wait_for(lambda: registered(run_dir, after_checkpoint), 240, after_checkpoint)
    victim = json.loads((run_dir / "workers" / f"rank{rank}.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    runner.join(timeout=400)
    assert not runner.is_alive()
    return outcome["result"], victim


def test_sigkilled_worker_restarts_from_checkpoint(workdir: Path) -> None:
    overrides = ["train.max_steps=300", "checkpoint.every_steps=50", "train.eval_every=100"]
    result, victim = sigkill_worker_mid_run(workdir, overrides, "killed", "checkpoint-00000100", rank=1)
    run_dir = workdir / "shoal_runs" / "killed"
    assert result.ok, result.reason
    assert result.step == 300 and result.restarts >= 1
    client = MlflowClient(result.tracking_uri)
    tags = client.get_run(result.run_id).data.tags
    assert int(tags["shoal.restarts"]) >= 1 and int(tags["shoal.attempts"]) >= 2
    events_file = client.download_artifacts(result.run_id, "events.json", str(workdir))
    events = json.loads(Path(events_file).read_text())
    kinds = [e["kind"] for e in events]
    assert "failure" in kinds
    restored = [e["restored_step"] for e in events if e["kind"] == "attempt_started"]
    assert restored[0] is None and restored[-1] >= 100
    assert loss_steps(client, result.run_id) == list(range(1, 301))
    new_rank1 = json.loads((run_dir / "workers" / "rank1.json").read_text())
    assert new_rank1["pid"] != victim


def shoal_cli(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_then_same_run_name_resumes(workdir: Path, ray_cluster: str) -> None:
    args = [
        "run",
        str(WORKLOADS / "quickstart.yaml"),
        "--address",
        ray_cluster,
        "--run-name",
        "again",
        "--set",
        "checkpoint.every_steps=50",
    ]
    first = shoal_cli(args, workdir)
    run_dir = workdir / "shoal_runs" / "again"
    wait_for(
        lambda: registered(run_dir, "checkpoint-00000100") or first.poll() is not None,
        300,
        "a checkpoint",
    )
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    assert "KILLED" in out and "Traceback" not in err

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (killed,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert killed.info.status == "KILLED"
    stopped_at = max(loss_steps(client, killed.info.run_id))
    assert stopped_at >= 100

    second = shoal_cli(args, workdir)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert f"MLflow run id: {killed.info.run_id}" in out
    resumed = client.get_run(killed.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert loss_steps(client, killed.info.run_id) == list(range(1, 401))  # continued, no duplicates
    events_file = client.download_artifacts(killed.info.run_id, "events.json", str(workdir))
    starts = [e for e in json.loads(Path(events_file).read_text()) if e["kind"] == "attempt_started"]
    assert starts[-1]["restored_step"] >= 100
    assert len(client.search_runs([resumed.info.experiment_id])) == 1


def test_restarts_are_bounded_by_max_restarts(workdir: Path) -> None:
    overrides = ["train.max_steps=2000", "checkpoint.every_steps=50", "failure.max_restarts=0"]
    result, _ = sigkill_worker_mid_run(workdir, overrides, "bounded", "checkpoint-00000050", rank=0)
    assert result.status == "FAILED" and result.restarts == 0
    assert "worker rank" in result.reason
    assert MlflowClient(result.tracking_uri).get_run(result.run_id).info.status == "FAILED"
