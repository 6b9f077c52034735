"""The `sweep` section: which dotted spec paths a sweep may search, and trial workloads.

A trial's workload is the base workload with one value per searched path. Every
value a trial may get (each listed value, both ends of a range) is validated
before the sweep starts, so that a bad space fails in `shoal validate`, not in
trial 7 an hour later.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import ValidationError

from shoal.messages import VAL_PREFIX
from shoal.spec.checks import VALUE_METRICS, check_batches
from shoal.spec.loader import Source, SpecIssue, describe_error
from shoal.spec.schema import SweepSpec, Workload

NOT_SEARCHABLE = ("name", "sweep", "tracking", "monitor", "checkpoint.storage", "checkpoint.endpoint")
FREE_FORM = ("model.args",)  # a model's own arguments: any key the model accepts


def with_values(resolved: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of a resolved workload with `values` ({dotted path: value}) set, sweep removed."""
    data = copy.deepcopy(resolved)
    data.pop("sweep", None)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        target = data
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return data


def _path_exists(resolved: dict[str, Any], path: str) -> bool:
    if any(path == free or path.startswith(f"{free}.") for free in FREE_FORM):
        return path not in FREE_FORM
    node: Any = resolved
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _value_problem(resolved: dict[str, Any], path: str, value: Any) -> str | None:
    try:
        trial = Workload.model_validate(with_values(resolved, {path: value}))
    except ValidationError as exc:
        return describe_error(exc.errors()[0])
    batches = check_batches(trial, Source("trial"))
    return batches[0].message if batches else None


def _domain_issues(sweep: SweepSpec, resolved: dict[str, Any], source: Source) -> list[SpecIssue]:
    issues = []
    for path, domain in sweep.space.items():
        where = f"sweep.space.{path}"
        if any(path == p or path.startswith(f"{p}.") for p in NOT_SEARCHABLE):
            issues.append(SpecIssue(source.where(where), where, f"'{path}' cannot be searched"))
        elif not _path_exists(resolved, path):
            issues.append(
                SpecIssue(source.where(where), where, f"'{path}' is not a setting of this workload")
            )
        else:
            for value in domain.values:
                problem = _value_problem(resolved, path, value)
                if problem:
                    message = f"{domain.kind} value {value!r} for {path}: {problem}"
                    issues.append(SpecIssue(source.where(where), where, message))
                    break
    return issues


def _strategy_issues(sweep: SweepSpec, workload: Workload, source: Source) -> list[SpecIssue]:
    kinds = {path: domain.kind for path, domain in sweep.space.items()}

    def issue(path: str, message: str) -> SpecIssue:
        return SpecIssue(source.where(path), path, message)

    if sweep.searcher == "grid":
        ranged = [p for p, k in kinds.items() if k not in ("grid", "choice")]
        if ranged:
            return [
                issue("sweep.searcher", f"grid search needs listed values; {ranged[0]} is {kinds[ranged[0]]}")
            ]
    if sweep.searcher == "optuna" or sweep.scheduler == "pbt":
        gridded = [p for p, k in kinds.items() if k == "grid"]
        who = "sweep.searcher" if sweep.searcher == "optuna" else "sweep.scheduler"
        if gridded:
            what = "optuna" if sweep.searcher == "optuna" else "pbt"
            return [issue(who, f"{what} samples its own values; make {gridded[0]} a choice, not a grid")]
    if sweep.scheduler in ("asha", "pbt") and workload.train.max_steps is None:
        return [issue("sweep.scheduler", f"{sweep.scheduler} needs train.max_steps (not epochs)")]
    if sweep.scheduler == "pbt":
        return _pbt_issues(sweep, workload, issue)
    return []


def _pbt_issues(sweep: SweepSpec, workload: Workload, issue: Any) -> list[SpecIssue]:
    every, evals = workload.checkpoint.every_steps, workload.train.eval_every
    if not every:
        return [issue("sweep.scheduler", "pbt copies checkpoints between trials: set checkpoint.every_steps")]
    if sweep.metric.startswith(VAL_PREFIX) and (not evals or every % evals):
        message = (
            f"pbt compares {sweep.metric} at checkpoints: make train.eval_every divide checkpoint.every_steps"
        )
        return [issue("sweep.metric", message)]
    if sweep.max_concurrent < sweep.samples:
        message = (
            f"pbt trains its population together: max_concurrent ({sweep.max_concurrent}) must be >= samples"
        )
        return [issue("sweep.max_concurrent", message)]
    return []


def check_sweep(workload: Workload, source: Source) -> list[SpecIssue]:
    sweep = workload.sweep
    if sweep is None:
        return []
    if sweep.metric not in VALUE_METRICS:
        allowed = ", ".join(VALUE_METRICS)
        return [
            SpecIssue(
                source.where("sweep.metric"), "sweep.metric", f"'{sweep.metric}' is not one of {allowed}"
            )
        ]
    if sweep.metric.startswith(VAL_PREFIX) and workload.data.train is not None and workload.data.val is None:
        message = f"{sweep.metric} needs validation data: set data.val or use train/loss"
        return [SpecIssue(source.where("sweep.metric"), "sweep.metric", message)]
    return _domain_issues(sweep, workload.resolved(), source) + _strategy_issues(sweep, workload, source)
