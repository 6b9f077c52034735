"""One MLflow run per shoal job, opened by the driver and re-opened on resume.

A job is identified by its run name (also Ray Train's run name): running the
same workload with the same run name finds the MLflow run tagged with it and
continues logging there.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from shoal.errors import ShoalError
from shoal.messages import Metric as MetricName  # mlflow.entities.Metric is a logged point
from shoal.redact import redact, without_credentials

RUN_NAME_TAG = "shoal.run_name"
RUN_DIR_TAG = "shoal.run_dir"
CWD_TAG = "shoal.cwd"

PARAM_LIMIT = 6000
RETRY_EVERY_S = 5.0  # while the store is unreachable, how often buffered writes are retried
# MLflow's HTTP client retries 7 times with exponential backoff (minutes per call) by default;
# shoal buffers and retries itself, so each call may fail fast. The user's settings win.
CLIENT_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    # MLflow prints "View run at <tracking URI>" itself, credentials and all; shoal's summary
    # names the run without them.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
log = logging.getLogger("shoal")


def ended_tag() -> dict[str, str]:
    """`shoal.ended`: when the run was closed, by its driver or by the driver's watch."""
    return {"shoal.ended": time.strftime("%Y-%m-%dT%H:%M:%S")}


class TrackingError(ShoalError, RuntimeError):
    """The tracking store cannot be reached or written."""


def resolve_uri(spec_uri: str | None) -> str:
    """The spec's `tracking.uri`, else $MLFLOW_TRACKING_URI, else ./mlflow.db (absolute)."""
    uri = spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    return uri


def tracking_client(uri: str) -> MlflowClient:
    """An MlflowClient for `uri`, for code that may be the first to touch its store.

    The first client of a sqlite store creates its tables (or upgrades their schema); several
    drivers starting at once against a new file (eight `shoal submit` in a row) ran that
    migration together and left the file unusable ('table _alembic_tmp_tags already exists'):
    so with sqlite the first touch happens under an exclusive lock on `<file>.lock`.
    """
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    return client


def experiment_id_of(client: MlflowClient, name: str) -> str:
    """The experiment's id, created when missing; another driver creating it at the same
    moment is not an error."""
    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as exc:
        found = client.get_experiment_by_name(name)
        if exc.error_code != "RESOURCE_ALREADY_EXISTS" or found is None:
            raise
        return found.experiment_id


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{path}."))
        else:
            text = json.dumps(value) if isinstance(value, (dict, list, tuple)) else str(value)
            flat[path] = text[:PARAM_LIMIT]
    return flat


def git_commit(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def version_tags() -> dict[str, str]:
    # deferred: the tracking layer stays torch- and Ray-free; only their versions are read here
    import mlflow
    import ray
    import torch

    from shoal.version import __version__

    return {
        "shoal.version": __version__,
        "shoal.torch_version": torch.__version__,
        "shoal.ray_version": ray.__version__,
        "shoal.mlflow_version": mlflow.__version__,
        "shoal.python_version": platform.python_version(),
    }


@dataclass
class TrackedRun:
    client: MlflowClient
    run_id: str
    experiment_id: str
    resumed: bool
    logged_until: int = 0  # highest step already logged for train/loss
    uri: str = ""
    # The status an earlier driver of this run name left, when it stopped before its first
    # checkpoint and this driver took its MLflow run over (training again from step 0).
    taken_over_from: str | None = None
    params_changed: list[str] = field(default_factory=list)
    # Writes the store has not taken yet (it is down or unreachable), sent in order later.
    pending: deque[Callable[[], None]] = field(default_factory=deque)
    retry_at: float = 0.0
    unreachable_since: float | None = None
    buffered_total: int = 0  # writes not taken on their first attempt, over this driver's run

    def _write(self, action: Callable[[], None]) -> None:
        self.pending.append(action)
        if not self.flush():  # writes go in order: this one, the last, is still waiting
            self.buffered_total += 1

    def flush(self, force: bool = False) -> bool:
        """Send buffered writes in order; True when none are left. While the store is
        unreachable, writes stay buffered and are retried every RETRY_EVERY_S."""
        if not force and self.pending and time.monotonic() < self.retry_at:
            return False
        while self.pending:
            try:
                self.pending[0]()
            except Exception as exc:
                if not is_unreachable(exc):
                    log.error("MLflow refused a write, dropped: %s", exc)
                    self.pending.popleft()
                    continue
                if self.unreachable_since is None:
                    self.unreachable_since = time.time()
                    log.warning("MLflow at %s is unreachable; buffering: %s", self.uri, exc)
                self.retry_at = time.monotonic() + RETRY_EVERY_S
                return False
            self.pending.popleft()
        if self.unreachable_since is not None:
            log.warning("MLflow at %s is back; buffered writes sent", self.uri)
            self.unreachable_since = None
        return True

    def flush_within(self, seconds: float) -> bool:
        """Keep retrying buffered writes for up to `seconds` (at the end of a run)."""
        deadline = time.monotonic() + seconds
        while not self.flush(force=True) and time.monotonic() < deadline:
            time.sleep(min(RETRY_EVERY_S, max(0.0, deadline - time.monotonic())))
        return not self.pending

    def log_metrics(self, rows: list[tuple[str, float, int, float | None]]) -> None:
        """Rows of (key, value, step, unix time it was measured, or None for now)."""
        now = time.time()
        metrics = [Metric(key, float(value), int(1000 * (at or now)), step) for key, value, step, at in rows]
        for start in range(0, len(metrics), 1000):
            chunk = metrics[start : start + 1000]
            self._write(lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk))

    def set_tags(self, tags: dict[str, Any]) -> None:
        batch = [RunTag(k, redact(str(v))) for k, v in tags.items()]
        self._write(lambda: self.client.log_batch(self.run_id, tags=batch))

    def log_json(self, data: Any, name: str) -> None:
        text = redact(json.dumps(data, indent=2, default=str))
        self._write(lambda: self.client.log_text(self.run_id, text, name))

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """A file (or, for a directory, its contents) written before this call, kept until sent."""
        if Path(local_path).is_dir():
            self._write(lambda: self.client.log_artifacts(self.run_id, local_path, artifact_path))
        else:
            self._write(lambda: self.client.log_artifact(self.run_id, local_path, artifact_path))

    def read_json(self, name: str) -> Any:
        """An artifact written by `log_json`, or None when there is none."""
        return read_json_artifact(self.client, self.run_id, name)

    def finish(self, status: str) -> None:
        self._write(lambda: self.client.set_terminated(self.run_id, status))


@contextmanager
def tracking_errors(where: str) -> Iterator[None]:
    """MLflow's (and the OS's) errors as one TrackingError that names `where`."""
    try:
        yield
    except MlflowException as exc:
        raise TrackingError(f"{where}: {exc.message}") from None
    except OSError as exc:
        raise TrackingError(f"{where}: {exc}") from None


def read_json_artifact(client: MlflowClient, run_id: str, name: str) -> Any:
    """A JSON artifact of a run, or None when there is none (or it cannot be read)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(run_id, name, tmp)).read_text())
    except (MlflowException, OSError, ValueError):
        return None


def is_unreachable(exc: BaseException) -> bool:
    """Whether a failed MLflow call means the store cannot be reached (worth retrying),
    rather than that it refused the request."""
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError)):
        return True
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        text = str(exc)
        return status >= 500 or status == 429 or "failed with exception" in text or "Max retries" in text
    return isinstance(exc, OSError)


def _find_run(client: MlflowClient, experiment_id: str, run_name: str, run_dir: str) -> str | None:
    def quoted(text: str) -> str:
        return text.replace("'", "\\'")

    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_NAME_TAG}` = '{quoted(run_name)}' "
        f"and tags.`{RUN_DIR_TAG}` = '{quoted(run_dir)}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return found[0].info.run_id if found else None


def _earlier_run(
    client: MlflowClient, experiment_id: str, run_name: str, run_dir: str, resume: bool
) -> tuple[str | None, str | None]:
    """The MLflow run this job continues, and the status it had when a driver left it
    without a checkpoint (None when there is nothing to take over).

    With checkpoints, the run of this name and directory resumes. Without any, a run of
    that name which never FINISHED was left by a driver that died (or failed, or was
    stopped) before its first checkpoint: this job takes it over and trains from step 0;
    the steps it had logged are not logged again (the recorder skips them). A FINISHED
    one stays as it is: its checkpoints are gone, so this is a new job.
    """
    found = _find_run(client, experiment_id, run_name, run_dir)
    if found is None or resume:
        return found if resume else None, None
    status = client.get_run(found).info.status
    return (found, status) if status != "FINISHED" else (None, None)


def _log_params(run: TrackedRun, params: dict[str, str]) -> None:
    existing = run.client.get_run(run.run_id).data.params if run.resumed else {}
    params = {key: redact(value) for key, value in params.items()}
    new = [Param(k, v) for k, v in params.items() if k not in existing]
    run.params_changed = [k for k, v in params.items() if k in existing and existing[k] != v]
    for start in range(0, len(new), 100):
        run.client.log_batch(run.run_id, params=new[start : start + 100])


def open_run(
    uri: str,
    experiment: str,
    run_name: str,
    run_dir: str,
    resume: bool,
    resolved_spec: dict[str, Any],
    spec_yaml: str,
    tags: dict[str, Any],
    run_id: str | None = None,
) -> TrackedRun:
    """Create the job's MLflow run or, with `resume`, re-open the one of this run name and dir.

    `resume` is true when the run directory holds checkpoints: a run name whose
    checkpoints are gone starts afresh, in a new MLflow run. A `run_id` made
    beforehand (by `shoal submit`, or a sweep for its trial) is used instead.
    Credentials in URIs (the tracking URI's, the spec's) are never written to the run:
    `spec_yaml` should come without them (`redact.without_credentials_data`); what is left
    of them anywhere is masked.
    """
    for key, value in CLIENT_ENV.items():
        os.environ.setdefault(key, value)
    run_dir = without_credentials(run_dir)
    with tracking_errors(f"MLflow at '{redact(uri)}'"):
        client = tracking_client(uri)
        experiment_id = experiment_id_of(client, experiment)
        stale = None
        if run_id is None:
            run_id, stale = _earlier_run(client, experiment_id, run_name, run_dir, resume)
        # A run made beforehand is resumed once it holds steps (a restarted sweep trial).
        history = client.get_metric_history(run_id, MetricName.TRAIN_LOSS.value) if run_id else []
        resumed = run_id is not None and (resume or bool(history) or stale is not None)
        identity = {RUN_NAME_TAG: run_name, RUN_DIR_TAG: run_dir}
        if run_id is None:
            run_id = client.create_run(experiment_id, run_name=run_name, tags=identity).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
            for key, value in identity.items():
                client.set_tag(run_id, key, value)
        run = TrackedRun(client, run_id, experiment_id, resumed, uri=uri, taken_over_from=stale)
        if stale is not None:
            run.set_tags({"shoal.taken_over_from": stale})
        if resumed:
            run.logged_until = max((m.step for m in history), default=0)
        _log_params(run, flatten(resolved_spec))
        run.set_tags({**version_tags(), **tags})
        if run.params_changed:
            run.set_tags({"shoal.params_changed_on_resume": ",".join(run.params_changed)})
        client.log_text(run_id, redact(spec_yaml), "workload.yaml")
    return run


@dataclass
class RecordedJob:
    """What `shoal resume RUN_ID` needs, as the MLflow run recorded it."""

    run_id: str
    run_name: str
    run_dir: str  # where the checkpoints are: a directory or s3://bucket/prefix/RUN
    cwd: str | None  # where relative paths in the spec were resolved
    spec_yaml: str
    status: str


def recorded_job(uri: str, run_id: str) -> RecordedJob:
    client = MlflowClient(tracking_uri=uri)
    with tracking_errors(f"MLflow run {run_id} at '{uri}'"):
        run = client.get_run(run_id)
        tags = run.data.tags
        if RUN_NAME_TAG not in tags or RUN_DIR_TAG not in tags:
            raise TrackingError(
                f"MLflow run {run_id} at '{uri}' was not started by shoal (no {RUN_DIR_TAG} tag)"
            )
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, "workload.yaml", tmp)
            spec_yaml = Path(path).read_text()
    return RecordedJob(
        run_id, tags[RUN_NAME_TAG], tags[RUN_DIR_TAG], tags.get(CWD_TAG), spec_yaml, run.info.status
    )
