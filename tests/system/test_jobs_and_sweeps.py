"""Ray jobs and Tune sweeps on a real two-node cluster made with `ray start` (token auth on).

`shoal submit` uploads the working directory and runs `shoal run` as a Ray job; a
second job is stopped mid-run. `shoal sweep` runs an ASHA sweep from a driver
attached to the cluster, is SIGKILLed mid-sweep and resumed with `--resume`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import quickstart, write_workload
from tests.integration.helpers import loss_steps, shoal_cli, wait_for


def finish(process: subprocess.Popen, timeout_s: float = 400) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout_s)
    return process.returncode, out + err


def mlflow(workdir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")


def test_submit_follows_to_success_and_stop_kills_the_run(workdir: Path, ray_start_cluster) -> None:
    cluster = ray_start_cluster
    write_workload(workdir, quickstart(), "quickstart.yaml")
    common = [
        "--address",
        cluster.dashboard,
        "--set",
        f"checkpoint.storage={workdir / 'shoal_runs'}",
        "--set",
        "train.eval_every=10",
        "--set",
        "checkpoint.every_steps=10",
    ]
    code, output = finish(
        shoal_cli(
            ["submit", "quickstart.yaml", *common, "--set", "train.max_steps=20"], workdir, **cluster.env
        )
    )
    assert code == 0, output
    job_id = re.search(r"submitted Ray job (\S+)", output).group(1)
    run_id = re.search(r"MLflow run id: (\w+)", output).group(1)
    assert f"job {job_id}: SUCCEEDED" in output
    run = mlflow(workdir).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["shoal.ray_job_id"] == job_id
    assert loss_steps(mlflow(workdir), run_id) == list(range(1, 21))
    code, status = finish(
        shoal_cli(["jobs", "status", job_id, "--address", cluster.dashboard], workdir, **cluster.env)
    )
    assert code == 0 and f"{job_id}: SUCCEEDED" in status and f"mlflow_run_id: {run_id}" in status, status

    long_run = ["--set", "train.max_steps=5000", "--detach"]
    code, output = finish(
        shoal_cli(["submit", "quickstart.yaml", *common, *long_run], workdir, **cluster.env)
    )
    assert code == 0, output
    second_job = re.search(r"submitted Ray job (\S+)", output).group(1)
    second_run = re.search(r"MLflow run id: (\w+)", output).group(1)
    wait_for(lambda: len(loss_steps(mlflow(workdir), second_run)) >= 10, 180, "the second job to train")
    code, stopped = finish(
        shoal_cli(["jobs", "stop", second_job, "--address", cluster.dashboard], workdir, **cluster.env)
    )
    assert code == 0 and f"{second_job}: STOPPED" in stopped, stopped
    wait_for(lambda: mlflow(workdir).get_run(second_run).info.status == "KILLED", 60, "the run to be KILLED")
    code, listing = finish(
        shoal_cli(["jobs", "list", "--address", cluster.dashboard], workdir, **cluster.env)
    )
    assert code == 0 and job_id in listing and second_job in listing and "STOPPED" in listing, listing


def test_a_missing_token_is_explained(workdir: Path, ray_start_cluster) -> None:
    env = {k: v for k, v in ray_start_cluster.env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env["HOME"] = str(workdir)  # no ~/.ray/auth_token
    process = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "jobs", "list", "--address", ray_start_cluster.dashboard],
        cwd=workdir,
        env={**env, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    code, output = finish(process, 60)
    assert code == 2, output
    assert "requires an authentication token (HTTP 401)" in output and "RAY_AUTH_TOKEN" in output
    assert "Traceback" not in output


SWEEP = {
    "name": "tiny",
    "model": {"family": "mlp", "args": {"hidden": 32}},
    "data": {"builtin": "digits", "batch_size": 32},
    "train": {"max_steps": 20, "eval_every": 5, "optimizer": {"lr": 0.01}},
    "scaling": {"workers": 1, "threads_per_worker": 1},
    "checkpoint": {"every_steps": 5},
    "sweep": {
        "metric": "val/accuracy",
        "mode": "max",
        "samples": 2,
        "max_concurrent": 2,
        "scheduler": "asha",
        "grace_period": 5,
        "space": {
            # A good and a hopeless learning rate, twice: ASHA stops a hopeless one.
            "train.optimizer.lr": {"grid": [0.03, 1.0e-6]},
            "model.args.hidden": {"choice": [16, 32]},
        },
    },
}


def placement_groups(cluster) -> list[str]:
    script = (
        f"import json, ray; ray.init(address='{cluster.gcs}', log_to_driver=False); "
        "from ray.util import placement_group_table; "
        "print(json.dumps([v['state'] for v in placement_group_table().values()]))"
    )
    done = subprocess.run([sys.executable, "-c", script], env=cluster.env, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def trial_results(sweep_dir: Path) -> int:
    return sum(1 for p in sweep_dir.glob("*/result.json") if p.stat().st_size > 0)


def test_asha_sweep_nests_runs_frees_resources_and_resumes(workdir: Path, ray_start_cluster) -> None:
    cluster = ray_start_cluster
    write_workload(workdir, SWEEP)
    args = ["sweep", "w.yaml", "--address", cluster.gcs, "--name", "s1"]
    first = shoal_cli(args, workdir, **cluster.env)
    sweep_dir = workdir / "shoal_runs" / "sweeps" / "s1"
    wait_for(lambda: trial_results(sweep_dir) >= 1 or first.poll() is not None, 240, "a first trial result")
    assert first.poll() is None, first.communicate()
    os.kill(first.pid, signal.SIGKILL)  # the sweep's driver dies mid-sweep
    first.wait()

    code, output = finish(shoal_cli([*args, "--resume"], workdir, **cluster.env))
    assert code == 0, output
    client = mlflow(workdir)
    experiment = client.get_experiment_by_name("tiny").experiment_id
    parents = client.search_runs([experiment], "tags.`shoal.role` = 'sweep'")
    assert [p.info.status for p in parents] == ["FINISHED"]
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert len({c.data.tags["shoal.trial_id"] for c in children}) == len(children) == 4
    stopped = [c for c in children if c.data.tags.get("shoal.early_stopped") == "true"]
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert stopped and all(c.info.status == "KILLED" for c in stopped), [c.info for c in children]
    assert len(stopped) + len(finished) == 4
    for child in stopped:
        assert max(loss_steps(client, child.info.run_id)) < 20
    for child in finished:
        assert loss_steps(client, child.info.run_id) == list(range(1, 21))

    winner = max(finished, key=lambda c: c.data.metrics["val/accuracy"])
    best = yaml.safe_load((sweep_dir / "best.yaml").read_text())
    assert best["train"]["optimizer"]["lr"] == float(winner.data.params["train.optimizer.lr"])
    assert (
        best["model"]["args"]["hidden"] == int(winner.data.params["model.args.hidden"])
        and "sweep" not in best
    )
    tags = parents[0].data.tags
    assert tags["shoal.best.trial"] == winner.data.tags["shoal.trial_id"] and "best configuration" in output
    code, checked = finish(shoal_cli(["validate", str(sweep_dir / "best.yaml")], workdir))
    assert code == 0, checked
    deadline = time.monotonic() + 60
    while set(placement_groups(cluster)) - {"REMOVED"} and time.monotonic() < deadline:
        time.sleep(2)
    assert set(placement_groups(cluster)) <= {"REMOVED"}
