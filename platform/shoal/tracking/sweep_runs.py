"""A sweep in MLflow: one parent run, one nested child run per trial.

Children carry MLflow's own `mlflow.parentRunId` tag, so the MLflow UI nests
them; `shoal.trial_id` finds a trial's run again when a killed sweep resumes.
"""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from shoal.tracking.mlflow_run import TrackingError, experiment_id_of, tracking_client

PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "shoal.sweep"
TRIAL_TAG = "shoal.trial_id"
EARLY_STOP_TAG = "shoal.early_stopped"


def _one(client: MlflowClient, experiment_id: str, filter_string: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=filter_string, max_results=1)
    return runs[0].info.run_id if runs else None


def open_parent(uri: str, experiment: str, sweep_name: str, params: dict[str, Any], spec_yaml: str) -> str:
    """The sweep's parent run: found again by its sweep name on resume, else created."""
    try:
        client = tracking_client(uri)
        experiment_id = experiment_id_of(client, experiment)
        parent = _one(
            client, experiment_id, f"tags.`{SWEEP_TAG}` = '{sweep_name}' and tags.`shoal.role` = 'sweep'"
        )
        if parent is None:
            tags = {SWEEP_TAG: sweep_name, "shoal.role": "sweep"}
            parent = client.create_run(experiment_id, run_name=sweep_name, tags=tags).info.run_id
            for key, value in params.items():
                client.log_param(parent, key, value)
            client.log_text(parent, spec_yaml, "sweep.yaml")
        else:
            client.update_run(parent, status="RUNNING")
    except MlflowException as exc:
        raise TrackingError(f"MLflow at '{uri}': {exc.message}") from None
    return parent


def trial_run(uri: str, experiment: str, parent_id: str, trial_id: str, run_name: str) -> str:
    """A trial's child run: the one it had before a resume, else a new one."""
    client = MlflowClient(tracking_uri=uri)
    experiment_id = experiment_id_of(client, experiment)
    found = _one(
        client, experiment_id, f"tags.`{PARENT_TAG}` = '{parent_id}' and tags.`{TRIAL_TAG}` = '{trial_id}'"
    )
    if found:
        return found
    tags = {PARENT_TAG: parent_id, TRIAL_TAG: trial_id, "shoal.role": "trial"}
    return client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id


def close_trial(uri: str, run_id: str, early_stopped: bool) -> None:
    """A trial the scheduler stopped (or whose process died with a killed sweep) ends KILLED."""
    client = MlflowClient(tracking_uri=uri)
    if early_stopped:
        client.set_tag(run_id, EARLY_STOP_TAG, "true")
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status="KILLED")


def finish_parent(uri: str, parent_id: str, status: str, tags: dict[str, Any], best_yaml: str | None) -> None:
    client = MlflowClient(tracking_uri=uri)
    for key, value in tags.items():
        client.set_tag(parent_id, key, value)
    if best_yaml:
        client.log_text(parent_id, best_yaml, "best.yaml")
    client.set_terminated(parent_id, status=status)
