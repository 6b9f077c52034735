"""Real faults on the shared cluster: Ctrl-C and a resumed run, bounded restarts.

(A SIGKILLed worker, audited for exact resume and exactly-once data: test_recovery.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from mlflow.tracking import MlflowClient

from shoal.launch import RunResult
from tests.conftest import WORKLOADS, quickstart
from tests.integration.conftest import run_workload
from tests.integration.helpers import loss_steps, registered, shoal_cli, wait_for, worker_pid


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
    victim = worker_pid(run_dir, rank)
    os.kill(victim, signal.SIGKILL)
    runner.join(timeout=400)
    assert not runner.is_alive()
    return outcome["result"], victim


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
