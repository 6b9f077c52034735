"""Run browsing (`shoal runs list | show | compare`): what MLflow recorded of shoal runs,
read through MLflow's client, so it works on a file store and on a tracking server."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from shoal.messages import EventKind, Metric, is_per_rank
from shoal.tracking.mlflow_run import (
    RUN_DIR_TAG,
    RUN_NAME_TAG,
    TrackingError,
    read_json_artifact,
    tracking_errors,
)

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
HEADLINE = (
    Metric.TRAIN_LOSS,
    Metric.VAL_LOSS,
    Metric.VAL_ACCURACY,
    Metric.TRAIN_SAMPLES_PER_S,
    Metric.PERF_MFU,
)


@dataclass
class RunDetails:
    run: Run
    experiment: str
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return run_name(self.run)

    @property
    def steps(self) -> int:
        return last_step(self.run)

    @property
    def attempts(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == EventKind.ATTEMPT_STARTED]

    @property
    def run_dir(self) -> str | None:
        return self.run.data.tags.get(RUN_DIR_TAG)


def run_name(run: Run) -> str:
    """The name shoal gave the run (MLflow's own name, or its id, for others)."""
    return run.data.tags.get(RUN_NAME_TAG) or run.info.run_name or run.info.run_id


def last_step(run: Run) -> int:
    """The step of the run's latest train/loss point (0 before the first step)."""
    # The latest metrics carry their steps only in RunData's public proto form.
    return max((m.step for m in run.data.to_proto().metrics if m.key == Metric.TRAIN_LOSS), default=0)


def list_runs(uri: str, experiment: str | None = None, limit: int = 50) -> list[tuple[Run, str]]:
    """shoal's runs (newest first) with their experiment names; one experiment or all."""
    with tracking_errors(f"MLflow at '{uri}'"):
        client = MlflowClient(tracking_uri=uri)
        if experiment is not None:
            found = client.get_experiment_by_name(experiment)
            if found is None:
                names = sorted(e.name for e in client.search_experiments())
                raise TrackingError(
                    f"no MLflow experiment '{experiment}' at '{uri}' "
                    f"(there are: {', '.join(names) or 'none'})"
                )
            experiments = [found]
        else:
            experiments = client.search_experiments()
        names = {e.experiment_id: e.name for e in experiments}
        runs = client.search_runs(list(names), order_by=["attributes.start_time DESC"], max_results=limit)
        return [(r, names[r.info.experiment_id]) for r in runs if _is_shoal(r)]


def _is_shoal(run: Run) -> bool:
    tags = run.data.tags
    return RUN_NAME_TAG in tags or tags.get("shoal.role") == "sweep"


def find_run(client: MlflowClient, ref: str) -> Run:
    """A run by id, or the newest shoal run of that name."""
    if RUN_ID.match(ref):
        return client.get_run(ref)
    experiments = [e.experiment_id for e in client.search_experiments()]
    quoted = ref.replace("'", "\\'")
    found = client.search_runs(
        experiments,
        filter_string=f"tags.`{RUN_NAME_TAG}` = '{quoted}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not found:
        raise TrackingError(f"no run with id or name '{ref}' (see shoal runs list)")
    return found[0]


def run_details(uri: str, ref: str) -> RunDetails:
    with tracking_errors(f"MLflow at '{uri}'"):
        client = MlflowClient(tracking_uri=uri)
        run = find_run(client, ref)
        experiment = client.get_experiment(run.info.experiment_id).name
        return RunDetails(run, experiment, read_json_artifact(client, run.info.run_id, "events.json") or [])


def differing_params(runs: list[Run]) -> list[str]:
    """Parameter keys whose values are not the same in every run (missing counts as a value)."""
    keys = sorted({k for r in runs for k in r.data.params})
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def metric_keys(runs: list[Run]) -> list[str]:
    """The headline metrics first, then every other final metric some run has."""
    present = {k for r in runs for k in r.data.metrics}
    rest = sorted(k for k in present if k not in HEADLINE and not is_per_rank(k))
    return [k for k in HEADLINE if k in present] + rest
