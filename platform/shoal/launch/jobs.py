"""`shoal submit` and `shoal jobs`: shoal runs as Ray jobs on a remote cluster (Ray Jobs API).

The job is `shoal run` on the cluster, with the working directory uploaded
(runtime_env working_dir), so that user model code travels with it. The MLflow
run is made before submission where the tracking store is reachable from here:
the job's metadata then names it, and the run records the Ray job id.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.tracking import MlflowClient

from shoal.errors import ShoalError
from shoal.launch.run import default_run_name
from shoal.redact import has_credentials, redact, without_credentials
from shoal.spec import load
from shoal.tracking import resolve_uri
from shoal.tracking.mlflow_run import RUN_NAME_TAG, experiment_id_of, tracking_client

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
UPLOAD_EXCLUDES = [".venv", ".git", "shoal_runs", "mlflow.db*", "mlruns", "__pycache__", "*.pyc"]
STOP_WAIT_S = 30  # a stopped job gets this long to record itself KILLED in MLflow
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class JobError(ShoalError, RuntimeError):
    """A cluster or job the Jobs API cannot reach or find."""


def token_paths() -> list[Path]:
    custom = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return [Path(custom)] if custom else [Path.home() / ".ray" / "auth_token"]


def use_token_if_available() -> None:
    """Ray clusters started with token auth refuse clients that do not send the token; Ray's
    client sends it only in RAY_AUTH_MODE=token, which must be set before Ray is imported."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if os.environ.get("RAY_AUTH_TOKEN") or any(p.is_file() for p in token_paths()):
        os.environ["RAY_AUTH_MODE"] = "token"


def _auth_hint(address: str) -> str:
    return (
        f"the Ray cluster at {address} requires an authentication token (HTTP 401). Put the "
        "cluster's token (on the head node: `ray get-auth-token`) in ~/.ray/auth_token, or set "
        "RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file>"
    )


def client(address: str | None) -> Any:
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or DEFAULT_ADDRESS
    if "://" not in address:
        address = f"http://{address}"
    use_token_if_available()
    # deferred: Ray loads when a cluster is contacted; `shoal run` imports this module, contacts none
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except AuthenticationError:
        raise JobError(_auth_hint(address)) from None
    except (ConnectionError, RuntimeError) as exc:
        if "401" in str(exc) or "Unauthorized" in str(exc):
            raise JobError(_auth_hint(address)) from None
        raise JobError(f"no Ray dashboard at --address {address}: {str(exc).splitlines()[0]}") from None


def leave_job_working_dir() -> None:
    """Inside a Ray job, work from a private copy of the uploaded working directory.

    Ray unpacks the upload once per node and, when it next sets up that runtime
    environment for a worker, deletes and unpacks it again (Ray 2.60,
    `working_dir` with overwrite): the job's driver, whose current directory it
    is, would find its directory gone. Workers hold their own reference. Jobs
    submitted from the same directory share one upload, so another job's workers
    may be unpacking it while this driver starts (eight submitted at once did):
    the copy is made under the lock Ray unpacks under.
    """
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return
    source = Path(os.readlink("/proc/self/cwd").removesuffix(" (deleted)"))
    private = Path(tempfile.mkdtemp(prefix="shoal-job-")) / "working_dir"
    with _unpack_lock(source):
        if not source.is_dir():
            raise JobError(f"the job's working directory {source} is gone (Ray removed its upload)")
        shutil.copytree(source, private, symlinks=True)
    os.chdir(private)


@contextmanager
def _unpack_lock(unpacked: Path) -> Iterator[None]:
    """Ray's lock (`filelock`, an flock) on an upload it unpacks at `unpacked`, if it is one."""
    lock_path = Path(f"{unpacked}.zip.lock")
    if not lock_path.exists():
        yield
        return
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _is_this_machine(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        return socket.gethostbyname(host) in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False


@dataclass
class Submission:
    job_id: str
    run_name: str
    mlflow_run_id: str | None
    tracking_uri: str
    warning: str | None = None


def _precreate_run(uri: str, experiment: str, run_name: str, job_tags: dict[str, str]) -> str | None:
    mlflow = tracking_client(uri)
    experiment_id = experiment_id_of(mlflow, experiment)
    tags = {RUN_NAME_TAG: run_name, **job_tags}
    return mlflow.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id


CREDENTIALS_STAY_HERE = (
    "credentials in URIs are not sent with the job (its entrypoint and metadata are readable by "
    "anyone with access to the cluster): the job takes them from the cluster's environment "
    "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, AWS_* or "
    "~/.aws/credentials)"
)


def _sent_override(item: str) -> str:
    """`key=value` as the job's entrypoint carries it: without credentials in the value."""
    key, equals, value = item.partition("=")
    return f"{key}{equals}{without_credentials(value)}" if has_credentials(value) else item


def _join(first: str | None, second: str) -> str:
    return f"{first}; {second}" if first else second


def submit(
    file: str,
    address: str | None,
    working_dir: str | None,
    overrides: list[str],
    run_name: str | None,
    python: str | None,
) -> Submission:
    """Validate here, make the MLflow run, upload the working directory and start `shoal run`."""
    loaded = load(file, overrides)  # bad input fails here, before anything is uploaded
    root = Path(working_dir or os.getcwd()).resolve()
    spec_path = Path(file).resolve()
    if not spec_path.is_relative_to(root):
        raise JobError(
            f"{file} is not inside --working-dir {root}: only that directory travels to the cluster"
        )
    jobs = client(address)
    w = loaded.workload
    run_name = run_name or default_run_name(w.name)
    uri, experiment = resolve_uri(w.tracking.uri), w.tracking.experiment or w.name
    warning, local_cluster = None, _is_this_machine(jobs.get_address())
    if uri.startswith("sqlite:") and not local_cluster:
        warning = f"MLflow store {uri} is a file on this machine; the cluster records into its own copy"
    try:
        run_id = _precreate_run(uri, experiment, run_name, {"shoal.workload": w.name})
    except Exception as exc:  # the store may be reachable from the cluster only
        run_id = None
        warning = f"could not create the MLflow run from here ({exc}); the job creates it on the cluster"
    sent = [_sent_override(item) for item in [*overrides, f"tracking.uri={uri}"]]
    if sent != [*overrides, f"tracking.uri={uri}"]:
        warning = _join(warning, CREDENTIALS_STAY_HERE)
    command = [python or (sys.executable if local_cluster else "python3")]
    command += ["-m", "shoal.cli", "run", str(spec_path.relative_to(root)), "--run-name", run_name]
    for item in sent:
        command += ["--set", item]
    if run_id:
        command += ["--mlflow-run-id", run_id]
    metadata = {
        "shoal.run_name": run_name,
        "shoal.workload": w.name,
        "mlflow_tracking_uri": without_credentials(uri),
    }
    if run_id:
        metadata["mlflow_run_id"] = run_id
    job_id = jobs.submit_job(
        entrypoint=shlex.join(command),
        runtime_env={
            "working_dir": str(root),
            "excludes": UPLOAD_EXCLUDES,
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), "PYTHONUNBUFFERED": "1"},
        },
        metadata=metadata,
    )
    if run_id:
        MlflowClient(tracking_uri=uri).set_tag(run_id, "shoal.ray_job_id", job_id)
    return Submission(job_id, run_name, run_id, redact(uri), warning and redact(warning))


async def _follow(jobs: Any, job_id: str, write: Any) -> None:
    async for chunk in jobs.tail_job_logs(job_id):
        write(chunk)


def follow(jobs: Any, job_id: str, write: Any = sys.stdout.write) -> str:
    """Stream a job's logs until it ends; its final status."""
    asyncio.run(_follow(jobs, job_id, write))
    for _ in range(60):  # the log stream ends a moment before the status is final
        status = str(jobs.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        time.sleep(1)
    return str(jobs.get_job_status(job_id).value)


def stop(jobs: Any, job_id: str, wait_s: float = STOP_WAIT_S + 30) -> str:
    info(jobs, job_id)
    jobs.stop_job(job_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = str(jobs.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        time.sleep(1)
    return str(jobs.get_job_status(job_id).value)


def info(jobs: Any, job_id: str) -> Any:
    """The job's details; a job id the cluster does not know is a user error."""
    try:
        return jobs.get_job_info(job_id)
    except RuntimeError as exc:
        raise JobError(f"no job '{job_id}' at {jobs.get_address()} ({str(exc).splitlines()[0]})") from None


def job_rows(jobs: Any) -> list[dict[str, Any]]:
    """The cluster's jobs, oldest first, as plain data (times in epoch milliseconds)."""
    rows = []
    for job in sorted(jobs.list_jobs(), key=lambda j: j.start_time or 0):
        meta = job.metadata or {}
        rows.append(
            {
                "job_id": job.submission_id or job.job_id,
                "status": str(job.status.value),
                "run_name": meta.get("shoal.run_name"),
                "mlflow_run_id": meta.get("mlflow_run_id"),
                "entrypoint": job.entrypoint,
                "start_time": job.start_time,
                "end_time": job.end_time,
            }
        )
    return rows


def job_status(jobs: Any, job_id: str) -> dict[str, Any]:
    """One job's status, message and metadata as plain data."""
    job = info(jobs, job_id)
    return {
        "job_id": job_id,
        "status": str(job.status.value),
        "message": job.message or None,
        "metadata": dict(job.metadata or {}),
    }
