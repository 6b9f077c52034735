"""`shoal sweep`: a workload's `sweep` section run through Ray Tune, one shoal job per trial.

The sweep is an MLflow parent run; each trial a nested child run (a whole shoal
job: checkpoints, restarts, exactly-once data). Tune's experiment state lives
in `<checkpoint.storage>/sweeps/<name>`, so a killed sweep goes on with
`shoal sweep FILE --resume`. The best configuration is written as a workload.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from ray import tune
from ray.util import placement_group_table

from shoal.launch.cluster import quiet_ray_logging, ray_session
from shoal.launch.sweep_view import TrialEvents
from shoal.launch.tuning import (
    SweepError,
    SweepResult,
    TrialOutcome,
    make_scheduler,
    make_searcher,
    run_trial,
    search_space,
)
from shoal.spec import LoadedWorkload
from shoal.spec.loader import apply_overrides, read_yaml
from shoal.spec.sweep import with_values
from shoal.tracking import resolve_uri
from shoal.tracking.sweep_runs import close_trial, finish_parent, open_parent

SWEEPS_DIR = "sweeps"
TRIAL_DRIVER_CPUS = 0.01
PLACEMENT_GROUP_WAIT_S = 30


@dataclass
class SweepOptions:
    address: str | None = None
    name: str | None = None
    resume: bool = False
    verbose: bool = False


def _local_root(storage: str) -> Path:
    if "://" in storage:
        raise SweepError(f"checkpoint.storage '{storage}': sweeps keep their state in a directory")
    return Path(storage).resolve() / SWEEPS_DIR


def _sweep_name(loaded: LoadedWorkload, root: Path, options: SweepOptions) -> str:
    prefix = f"{loaded.workload.name}-sweep-"
    if not options.resume:
        return options.name or f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}"
    if options.name:
        if not tune.Tuner.can_restore(str(root / options.name)):
            raise SweepError(f"--resume: no sweep named '{options.name}' in {root}")
        return options.name
    candidates = sorted(p for p in root.glob(f"{prefix}*") if tune.Tuner.can_restore(str(p)))
    if not candidates:
        raise SweepError(f"--resume: no sweep of '{loaded.workload.name}' to resume in {root}")
    return candidates[-1].name


def is_whole_state(state: Path) -> bool:
    """One of Tune's experiment_state files reads back as JSON (not empty, not cut short)."""
    try:
        json.loads(state.read_text())
    except ValueError:  # empty or cut short (UnicodeDecodeError is one too)
        return False
    return True


def set_aside_torn_state(sweep_dir: Path) -> None:
    """Ray Tune copies its experiment state into the sweep's folder in place after each save: a
    driver killed during the copy leaves a cut-short file, which Tune restores as a sweep whose
    trials have no settings. Such files are renamed `*.torn`, so that Tune restores the newest
    whole state (one per earlier session of the sweep); none left is a SweepError."""
    states = sorted(sweep_dir.glob("experiment_state-*.json"))  # Tune restores the newest name
    torn = []
    for state in reversed(states):
        if is_whole_state(state):
            return
        state.rename(state.with_name(state.name + ".torn"))
        torn.append(state.name)
    raise SweepError(
        f"--resume: sweep '{sweep_dir.name}' in {sweep_dir.parent} has no whole saved state "
        f"({', '.join(torn) or 'none'} cut short: its driver was killed while Ray Tune was writing it); "
        "run it again without --resume"
    )


def _base_workload(loaded: LoadedWorkload) -> dict[str, Any]:
    """The resolved workload, with paths made absolute for trials that may run elsewhere."""
    base = loaded.workload.resolved()
    base["checkpoint"]["storage"] = str(Path(base["checkpoint"]["storage"]).resolve())
    base["tracking"]["uri"] = resolve_uri(base["tracking"]["uri"])
    for split in ("train", "val"):
        if base["data"].get(split) and "://" not in base["data"][split]["path"]:
            base["data"][split]["path"] = str(Path(base["data"][split]["path"]).resolve())
    return base


def _tuner(loaded: LoadedWorkload, name: str, root: Path, context: dict[str, Any], resume: bool):
    sweep = loaded.workload.sweep

    def shoal_trial(config: dict[str, Any]) -> None:
        run_trial(config, context=context)

    # The trial's own actor only drives its job: the job's workers reserve their own resources.
    trainable = tune.with_resources(shoal_trial, {"cpu": TRIAL_DRIVER_CPUS})
    if resume:
        return tune.Tuner.restore(str(root / name), trainable, resume_unfinished=True, resume_errored=True)
    return tune.Tuner(
        trainable,
        param_space=search_space(sweep),
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=sweep.samples,
            max_concurrent_trials=sweep.max_concurrent,
            scheduler=make_scheduler(sweep, loaded.workload, root / name),
            search_alg=make_searcher(sweep),
        ),
        run_config=tune.RunConfig(name=name, storage_path=str(root), callbacks=[TrialEvents()], verbose=0),
    )


def sweep(loaded: LoadedWorkload, options: SweepOptions) -> SweepResult:
    """Run (or resume) the workload's sweep (a `sweep_view.SweepTable` shows it if open)."""
    w = loaded.workload
    if w.sweep is None:
        raise SweepError(f"{loaded.source.file}: no 'sweep' section to run")
    root = _local_root(w.checkpoint.storage)
    name = _sweep_name(loaded, root, options)
    if options.resume:  # refused before Ray starts or the MLflow parent run is touched
        set_aside_torn_state(root / name)
    make_searcher(w.sweep)  # a missing optional package is reported before anything starts
    base = _base_workload(loaded)
    uri, experiment = base["tracking"]["uri"], w.tracking.experiment or w.name
    quiet_ray_logging(root / name / "driver.log", options.verbose)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the table below replaces Tune's own output
    params = {f"sweep.{k}": v for k, v in w.sweep.model_dump(mode="json").items() if k != "space"}
    params.update({f"space.{p}": str(d.model_dump(exclude_none=True)) for p, d in w.sweep.space.items()})
    parent = open_parent(uri, experiment, name, params, yaml.safe_dump(base, sort_keys=False))
    context = {
        "base": base,
        "paths": list(w.sweep.space),
        "sweep": name,
        "parent": parent,
        "uri": uri,
        "experiment": experiment,
        "metric": w.sweep.metric,
        "pbt": w.sweep.scheduler == "pbt",
        "cwd": os.getcwd(),
    }
    result = SweepResult(name, str(root / name), parent, experiment, uri, w.sweep.metric, w.sweep.mode)
    cpus = w.scaling.worker_range()[1] * w.scaling.cpus_per_worker * w.sweep.max_concurrent
    status = "FAILED"
    try:
        with ray_session(options.address, cpus, options.verbose, dashboard=True):
            before = _placement_groups()
            grid = _tuner(loaded, name, root, context, options.resume).fit()
            result.placement_groups_left = _reserved_since(before)
        _collect(result, grid, w.train.max_steps)
        _write_best(result, loaded, root / name)
        status = "FINISHED" if result.best else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        _close_trials(result)
        tags = {"shoal.placement_groups_left": result.placement_groups_left}
        if result.best:
            best = {"trial": result.best.trial_id, result.metric: result.best.metric, **result.best.params}
            tags.update({f"shoal.best.{key}": value for key, value in best.items()})
        finish_parent(uri, parent, status, tags, result.best_yaml)
    return result


def _placement_groups() -> dict[str, str]:
    return {pg_id: entry["state"] for pg_id, entry in placement_group_table().items()}


def _reserved_since(before: dict[str, str], wait_s: float = PLACEMENT_GROUP_WAIT_S) -> int:
    """Placement groups made during the sweep that still hold resources. Stopped trials' groups
    are removed by Ray Train's cleaner a moment after their trial ends, hence the wait."""
    deadline = time.monotonic() + wait_s
    while True:
        held = [i for i, state in _placement_groups().items() if i not in before and state != "REMOVED"]
        if not held or time.monotonic() > deadline:
            return len(held)
        time.sleep(1)


def _collect(result: SweepResult, grid: Any, max_steps: int | None) -> None:
    for trial in grid:
        metrics = trial.metrics or {}
        step = int(metrics.get("step", 0))
        total = int(metrics.get("total_steps") or max_steps or 0)
        if trial.error:
            status = "ERROR"
        elif not metrics:
            status = "PENDING"
        else:
            status = "FINISHED" if step >= total else "STOPPED"
        trial_id = metrics.get("trial_id") or Path(trial.path).name
        params = {k: v.item() if hasattr(v, "item") else v for k, v in trial.config.items()}
        run_id = metrics.get("mlflow_run_id")
        result.trials.append(TrialOutcome(trial_id, params, status, step, metrics.get(result.metric), run_id))
    finished = [t for t in result.trials if t.status == "FINISHED" and t.metric is not None]
    if finished:
        pick = min if result.mode == "min" else max
        result.best = pick(finished, key=lambda t: t.metric)


def _write_best(result: SweepResult, loaded: LoadedWorkload, directory: Path) -> None:
    if result.best is None:
        return
    raw, source = read_yaml(loaded.source.file)
    apply_overrides(raw, list(loaded.source.overrides.values()), source)  # the sweep's --set too
    raw.pop("sweep", None)
    raw["name"] = f"{loaded.workload.name}-best"
    best = with_values(raw, result.best.params)
    header = (
        f"# The best trial of sweep {result.name} ({result.metric} = {result.best.metric:.6g}, "
        f"{result.mode}), from {loaded.source.file}.\n"
    )
    result.best_yaml = header + yaml.safe_dump(best, sort_keys=False)
    path = directory / "best.yaml"
    path.write_text(result.best_yaml)
    result.best_file = str(path)


def _close_trials(result: SweepResult) -> None:
    """Trials stopped early (or left running by a killed sweep) end KILLED in MLflow."""
    for trial in result.trials:
        if trial.run_id and trial.status in ("STOPPED", "PENDING"):
            close_trial(result.tracking_uri, trial.run_id, early_stopped=trial.status == "STOPPED")
