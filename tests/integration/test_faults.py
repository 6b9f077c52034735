"""Bounded restarts on the shared cluster.

(A SIGKILLed worker, audited for exact resume and exactly-once data: test_recovery.py;
Ctrl-C, a killed driver and resuming: test_job_resume.py.)"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from mlflow.tracking import MlflowClient

from shoal.launch import RunResult
from tests.conftest import quickstart
from tests.integration.conftest import run_workload
from tests.integration.helpers import registered, wait_for, worker_pid


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


def test_restarts_are_bounded_by_max_restarts(workdir: Path) -> None:
    overrides = ["train.max_steps=2000", "checkpoint.every_steps=50", "failure.max_restarts=0"]
    result, _ = sigkill_worker_mid_run(workdir, overrides, "bounded", "checkpoint-00000050", rank=0)
    assert result.status == "FAILED" and result.restarts == 0
    assert "worker rank" in result.reason
    assert MlflowClient(result.tracking_uri).get_run(result.run_id).info.status == "FAILED"
