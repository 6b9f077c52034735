"""Bounded restarts on the shared cluster.

(A SIGKILLed worker, audited for exact resume and exactly-once data: test_recovery.py;
Ctrl-C, a killed driver and resuming: test_job_resume.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.conftest import quickstart
from tests.integration.conftest import run_in_thread
from tests.integration.helpers import registered, wait_for, worker_pid


def test_restarts_are_bounded_by_max_restarts(workdir: Path) -> None:
    overrides = ["train.max_steps=2000", "checkpoint.every_steps=50", "failure.max_restarts=0"]
    runner, outcome = run_in_thread(workdir, quickstart(), "bounded", overrides)
    run_dir = workdir / "shoal_runs" / "bounded"
    wait_for(lambda: registered(run_dir, "checkpoint-00000050"), 240, "checkpoint 50")
    os.kill(worker_pid(run_dir, 0), signal.SIGKILL)
    runner.join(timeout=400)
    result = outcome["result"]
    assert result.status == "FAILED" and result.restarts == 0
    assert "worker rank" in result.reason
    assert MlflowClient(result.tracking_uri).get_run(result.run_id).info.status == "FAILED"
