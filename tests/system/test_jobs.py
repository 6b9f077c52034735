"""Ray jobs on a real two-node cluster made with `ray start` (token auth on).

`shoal submit` uploads the working directory and runs `shoal run` as a Ray job that is
followed to SUCCEEDED; a second job is stopped mid-run; a client without the token
is told how to provide it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

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
    code, logs = finish(
        shoal_cli(["jobs", "logs", job_id, "--address", cluster.dashboard], workdir, **cluster.env)
    )
    assert code == 0 and "FINISHED" in logs and f"MLflow run id: {run_id}" in logs, logs

    long_run = ["--set", "train.max_steps=5000", "--detach"]
    code, output = finish(
        shoal_cli(["submit", "quickstart.yaml", *common, *long_run], workdir, **cluster.env)
    )
    assert code == 0, output
    second_job = re.search(r"submitted Ray job (\S+)", output).group(1)
    second_run = re.search(r"MLflow run id: (\w+)", output).group(1)
    wait_for(lambda: len(loss_steps(mlflow(workdir), second_run)) >= 1, 180, "the second job to train")
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


def test_credentials_in_uris_are_never_stored(workdir: Path, ray_start_cluster, mlflow_server) -> None:
    """A run and a submitted job whose tracking URI carries a password: both track into the
    server, and the password is in none of the run directory, the MLflow server's store and
    artifacts, the job's info, its logs, or what shoal printed."""
    cluster, secret = ray_start_cluster, f"marker{uuid.uuid4().hex}"
    uri = mlflow_server.uri.replace("http://", f"http://shoal:{secret}@")
    write_workload(workdir, quickstart(), "quickstart.yaml")
    common = [
        *("--set", f"tracking.uri={uri}", "--set", f"checkpoint.storage={workdir / 'shoal_runs'}"),
        *("--set", "train.max_steps=10", "--set", "checkpoint.every_steps=5", "--set", "train.eval_every=5"),
    ]
    code, ran = finish(
        shoal_cli(["run", "quickstart.yaml", "--run-name", "local", *common], workdir, **cluster.env)
    )
    assert code == 0, ran
    code, submitted = finish(
        shoal_cli(
            ["submit", "quickstart.yaml", "--address", cluster.dashboard, *common], workdir, **cluster.env
        )
    )
    assert code == 0 and "credentials in URIs are not sent with the job" in submitted, submitted
    job_id = re.search(r"submitted Ray job (\S+)", submitted).group(1)
    tracked = MlflowClient(mlflow_server.uri)
    runs = tracked.search_runs([e.experiment_id for e in tracked.search_experiments()])
    job_run = re.search(r"\(run (\S+)\)", submitted).group(1)
    assert sorted(r.data.tags["shoal.run_name"] for r in runs) == sorted(["local", job_run])
    assert all(r.info.status == "FINISHED" for r in runs)
    assert len(runs) == 2 and all(loss_steps(tracked, r.info.run_id) == list(range(1, 11)) for r in runs)

    shown = [ran, submitted]
    for command in (["status", job_id], ["logs", job_id], ["list"]):
        code, out = finish(
            shoal_cli(["jobs", *command, "--address", cluster.dashboard], workdir, **cluster.env)
        )
        assert code == 0, out
        shown.append(out)
    info = (
        f"from shoal.launch import jobs; print(jobs.client({cluster.dashboard!r}).get_job_info({job_id!r}))"
    )
    job = subprocess.run(
        [sys.executable, "-c", info], env=cluster.env, capture_output=True, text=True, timeout=120, check=True
    )
    assert "entrypoint=" in job.stdout and "mlflow_tracking_uri" in job.stdout, job.stdout + job.stderr
    shown.append(job.stdout)
    assert all(secret not in text for text in shown), [text for text in shown if secret in text][0]
    leaked = [p for p in workdir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == [], leaked  # run dirs, logs, server.db, artifacts
    assert (
        any(p.name == "server.db" for p in workdir.rglob("*")) and (workdir / "shoal_runs" / "local").is_dir()
    )


STORM = 8
# One process that waits for every job to end (bounded), then prints their statuses.
WAIT_FOR_JOBS = """
import sys, time
from shoal.launch import jobs
client, ids = jobs.client(sys.argv[1]), sys.argv[2:]
deadline = time.monotonic() + 1200
while time.monotonic() < deadline:
    states = [str(client.get_job_status(j).value) for j in ids]
    if all(s in ("SUCCEEDED", "FAILED", "STOPPED") for s in states):
        break
    time.sleep(5)
print(" ".join(states))
"""
PLACEMENT_GROUP_STATES = """
import ray
ray.init(log_to_driver=False)
print(sorted({p["state"] for p in ray.util.placement_group_table().values()}))
"""


def test_a_submission_storm_queues_every_job_to_success(workdir: Path, ray_start_cluster) -> None:
    """Eight `shoal submit --detach` at once to two nodes with room for three runs: the rest
    wait for room (Ray Train asks again for its workers' placement group) instead of failing;
    each ends SUCCEEDED with one FINISHED MLflow run, and no placement group is left."""
    cluster = ray_start_cluster
    write_workload(workdir, quickstart(), "quickstart.yaml")
    args = ["submit", "quickstart.yaml", "--address", cluster.dashboard, "--detach"]
    args += ["--set", f"checkpoint.storage={workdir / 'shoal_runs'}", "--set", "train.max_steps=10"]
    args += ["--set", "checkpoint.every_steps=10", "--set", "train.eval_every=1000"]
    args += ["--set", "failure.worker_start_timeout_s=5"]  # a waiting job asks for room every 5 s
    submits = [shoal_cli([*args, "--run-name", f"storm-{i}"], workdir, **cluster.env) for i in range(STORM)]
    outputs = [finish(process, 300) for process in submits]
    assert all(code == 0 for code, _ in outputs), outputs
    jobs = [re.search(r"submitted Ray job (\S+)", out).group(1) for _, out in outputs]

    done = subprocess.run(
        [sys.executable, "-c", WAIT_FOR_JOBS, cluster.dashboard, *jobs],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=1300,
    )
    assert done.stdout.split() == ["SUCCEEDED"] * STORM, done.stdout + done.stderr
    client = mlflow(workdir)
    runs = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    storm = {
        r.data.tags["shoal.run_name"]: r for r in runs if r.data.tags["shoal.run_name"].startswith("storm-")
    }
    assert sorted(storm) == [f"storm-{i}" for i in range(STORM)]  # one run each
    assert all(
        r.info.status == "FINISHED" and loss_steps(client, r.info.run_id) == list(range(1, 11))
        for r in storm.values()
    )
    code, listing = finish(
        shoal_cli(["jobs", "list", "--address", cluster.dashboard], workdir, **cluster.env)
    )
    assert code == 0 and all(job in listing for job in jobs), listing
    # Room for three at a time: some run took its first step after another had finished.
    steps = [client.get_metric_history(r.info.run_id, "train/loss") for r in storm.values()]
    assert max(min(m.timestamp for m in h) for h in steps) > min(max(m.timestamp for m in h) for h in steps)
    placed = subprocess.run(
        [sys.executable, "-c", PLACEMENT_GROUP_STATES],
        env=cluster.env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert placed.stdout.strip().splitlines()[-1] in ("[]", "['REMOVED']"), placed.stdout
