"""The Slurm path on a real Slurm: `cluster_configs/slurm/shoal.sbatch` submitted with `sbatch`
to a slurmctld and two slurmd nodes in network namespaces of the test's own (see slurm.py).

A two-node job starts the Ray head on the first node and joins the second through `srun`,
trains the quickstart across both (one worker per node) and ends with the MLflow run FINISHED;
a second job, cancelled with `scancel` mid-run, leaves no Ray process on any node and its
MLflow run KILLED. Skipped, with the reason, where network namespaces are not permitted or
Slurm cannot be installed.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from shoal.tracking.mlflow_run import RUN_NAME_TAG
from tests.conftest import REPO, quickstart, write_workload
from tests.integration.helpers import loss_steps
from tests.system.netns import Network, why_not_permitted
from tests.system.slurm import KILL_WAIT_S, SlurmCluster, wait_until, why_not_available

NOT_PERMITTED = why_not_permitted()
pytestmark = pytest.mark.skipif(NOT_PERMITTED is not None, reason=NOT_PERMITTED or "")
SBATCH = REPO / "cluster_configs" / "slurm" / "shoal.sbatch"
STEPS, NODE_CPUS = 24, 2
# What the test's machine has: no GPUs; each node 2 CPUs, one 2-CPU worker on each.
SBATCH_OPTIONS = ["--gpus-per-node=0", f"--cpus-per-task={NODE_CPUS}", "--time=00:10:00"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
RAY_NAMES = {"ray", "raylet", "gcs_server", "shoal"}


@pytest.fixture
def slurm(workdir: Path) -> Iterator[SlurmCluster]:
    """A controller and two compute nodes."""
    reason = why_not_available()
    if reason is not None:
        pytest.skip(reason)
    with Network(workdir) as net:
        cluster = SlurmCluster(net, net.add("ctl"), [net.add("node1"), net.add("node2")], NODE_CPUS, 1024)
        cluster.start()
        yield cluster


@pytest.fixture
def job_env() -> dict[str, str]:
    """What sbatch exports to the jobs besides the network's environment (Ray's temp dir of
    the test's own among it): this venv, a token for the cluster's Ray, gloo on the links."""
    return {
        "SHOAL_VENV": sys.prefix,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "GLOO_SOCKET_IFNAME": "eth0",
        "RAY_raylet_start_wait_time_s": "120",  # 2 cores: a raylet may take a while
        "SHOAL_RAY_START_TIMEOUT_S": "120",
        "SHOAL_AUDIT_SAMPLES": "1",  # audit/rankN.jsonl: a line per step, as it is trained
        "COLUMNS": "160",
    }


def ray_processes(slurm: SlurmCluster) -> list[str]:
    """`NODE: command line` of every Ray (or shoal) process left in a compute node's namespace."""
    found = []
    for node in slurm.nodes:
        pids = subprocess.run(["ip", "netns", "pids", node.namespace], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue  # gone meanwhile
            names = {Path(arg).name for arg in argv} | {arg.split(".")[0] for arg in argv}
            if names & RAY_NAMES or any(arg.startswith("ray::") or "/ray/" in arg for arg in argv):
                found.append(f"{slurm.name(node)}: {' '.join(argv)[:200]}")
    return found


def mlflow_run(workdir: Path, name: str) -> tuple[MlflowClient, Run]:
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("quickstart")
    assert experiment is not None, "no MLflow experiment: the driver never started"
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`{RUN_NAME_TAG}` = '{name}'")
    return client, run


def workload(workdir: Path, steps: int) -> None:
    data = quickstart()
    data["model"]["args"] = {"channels": 8}
    data["train"].update(max_steps=steps, eval_every=1000)
    data["checkpoint"]["every_steps"] = 12
    data["scaling"] = {"workers": 2, "cpus_per_worker": NODE_CPUS, "threads_per_worker": 1}
    write_workload(workdir, data, "w.yaml")


def test_the_sbatch_script_trains_across_two_nodes_and_scancel_leaves_nothing(
    workdir: Path, slurm: SlurmCluster, job_env: dict[str, str]
) -> None:
    workload(workdir, STEPS)
    started = time.monotonic()
    job = slurm.sbatch(SBATCH, SBATCH_OPTIONS, ["w.yaml"], workdir, job_env)
    fields = slurm.wait_for_job(job, ENDED, 300)
    output = (workdir / f"shoal-{job}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (
        f"{fields}\n{output[-4000:]}\n{slurm.logs()}"
    )
    print(f"job {job}: COMPLETED on {fields['NodeList']} in {time.monotonic() - started:.0f} s")
    assert f"Ray head node1 ({slurm.nodes[0].address}:6379), workers: node2" in output
    client, run = mlflow_run(workdir, f"slurm-{job}")
    assert run.info.status == "FINISHED"
    assert loss_steps(client, run.info.run_id) == list(range(1, STEPS + 1))  # each step once
    run_dir = workdir / "shoal_runs" / f"slurm-{job}"
    hosts = {json.loads(p.read_text())["host"] for p in (run_dir / "workers").glob("rank*.json")}
    assert hosts == {"node1", "node2"}, hosts  # a worker on each node
    assert ray_processes(slurm) == []  # the job's end stopped them all

    workload(workdir, 5000)  # a run that is still training when it is cancelled
    job = slurm.sbatch(SBATCH, SBATCH_OPTIONS, ["w.yaml"], workdir, job_env)
    output_file = workdir / f"shoal-{job}.out"
    audit = workdir / "shoal_runs" / f"slurm-{job}" / "audit" / "rank1.jsonl"
    ended = lambda: slurm.job(job).get("JobState") in ENDED  # noqa: E731
    wait_until(lambda: (audit.exists() and audit.stat().st_size > 0) or ended(), 300, "training to start")
    assert not ended(), output_file.read_text()[-4000:]
    cancelled_at = time.monotonic()
    assert slurm.command("scancel", job).returncode == 0
    # CANCELLED, no longer COMPLETING: every process Slurm tracks has ended, and before
    # Slurm's SIGKILL (KILL_WAIT_S after the SIGTERM): the script and Ray stopped them
    fields = slurm.wait_for_job(job, ENDED, KILL_WAIT_S - 10)
    assert fields["JobState"] == "CANCELLED", fields
    print(f"job {job}: scancel -> job ended in {time.monotonic() - cancelled_at:.1f} s")
    assert ray_processes(slurm) == []  # none escaped Slurm's tracking either
    client, run = mlflow_run(workdir, f"slurm-{job}")
    output = output_file.read_text()
    assert run.info.status == "KILLED", output[-4000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output, output[-4000:]
