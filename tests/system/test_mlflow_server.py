"""A real `mlflow server` on loopback: a run tracked there is browsable with `shoal runs` and
MLflow's REST API; the server is SIGKILLed mid-run and restarted, training goes on, and the
metrics written meanwhile are buffered and sent: none lost, none twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.conftest import write_workload
from tests.integration.helpers import SLOW_MODEL, shoal_cli, wait_for
from tests.system.conftest import MlflowServer

STEPS = 150


def test_server_outage_is_buffered_and_runs_are_browsable(workdir: Path, mlflow_server: MlflowServer) -> None:
    (workdir / "slow_model.py").write_text(SLOW_MODEL)
    write_workload(
        workdir,
        {
            "name": "served",
            "model": {"target": "slow_model:Slow"},
            "data": {"builtin": "digits", "batch_size": 16},
            "train": {"max_steps": STEPS, "eval_every": 50},
            "scaling": {"workers": 1, "threads_per_worker": 1},
            "checkpoint": {"every_steps": 50},
            "tracking": {"uri": mlflow_server.uri},
        },
    )
    job = shoal_cli(["run", "w.yaml", "--run-name", "served"], workdir)
    client = MlflowClient(mlflow_server.uri)

    def logged_steps() -> int:
        experiment = client.get_experiment_by_name("served")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        return len(client.get_metric_history(runs[0].info.run_id, "train/loss")) if runs else 0

    wait_for(lambda: logged_steps() >= 20, 300, "20 steps in MLflow")
    mlflow_server.kill()
    time.sleep(10)  # training goes on with nowhere to write
    assert job.poll() is None, "the run should outlive the tracking server's outage"
    mlflow_server.start()
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, out + err

    run = client.search_runs([client.get_experiment_by_name("served").experiment_id])[0]
    run_id = run.info.run_id
    got = mlflow_server.rest(f"runs/get?run_id={run_id}")["run"]
    assert got["info"]["status"] == "FINISHED"
    tags = {t["key"]: t["value"] for t in got["data"]["tags"]}
    assert int(tags["shoal.buffered_writes"]) > 0  # writes waited for the server to come back
    history = mlflow_server.rest(
        f"metrics/get-history?run_id={run_id}&metric_key=train/loss&max_results=1000"
    )
    assert sorted(int(m["step"]) for m in history["metrics"]) == list(range(1, STEPS + 1))
    for key in ("val/accuracy", "time/step_s", "train/samples_per_s"):
        assert client.get_metric_history(run_id, key), key
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for a in client.list_artifacts(run_id, "plots")
    }
    assert {"events.json", "workload.yaml", "plots/training.png"} <= artifacts

    listing = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "runs", "list", "--tracking-uri", mlflow_server.uri],
        cwd=workdir, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert listing.returncode == 0 and run_id in listing.stdout and "FINISHED" in listing.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "runs", "show", "served", "--tracking-uri", mlflow_server.uri],
        cwd=workdir, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert (
        shown.returncode == 0 and "attempt_started" in shown.stdout and "checkpoint-00000150" in shown.stdout
    )
