"""Checks that span sections or look outside the spec (model classes, data files).

Each returns SpecIssues naming the path at fault; `shoal validate` runs them all
before anything is launched.
"""

from __future__ import annotations

from pathlib import Path

from shoal.data import DataError, DataPlan, plan_data
from shoal.models import ModelError, check_args, model_class, model_task
from shoal.spec.loader import Source, SpecIssue
from shoal.spec.schema import Workload


def _issue(source: Source, path: str, message: str) -> SpecIssue:
    return SpecIssue(source.where(path), path, message)


def check_batches(workload: Workload, source: Source) -> list[SpecIssue]:
    micro = workload.data.batch_size
    wanted = workload.train.global_batch_size
    if wanted is None:
        return []
    issues = []
    for world in sorted(set(workload.scaling.worker_range())):
        if wanted % (micro * world):
            issues.append(
                _issue(
                    source,
                    "train.global_batch_size",
                    f"{wanted} is not a multiple of data.batch_size ({micro}) x {world} workers "
                    f"= {micro * world}; accumulation needs a whole number of micro-batches",
                )
            )
    return issues


def check_model(workload: Workload, source: Source) -> tuple[str | None, list[SpecIssue]]:
    """The model's task, or the issues that stop us knowing it."""
    spec = workload.model
    where = "model.family" if spec.family is not None else "model.target"
    try:
        cls = model_class(spec.family, spec.target)
        task = model_task(cls, spec.task)
        check_args(cls, spec.args)
    except ModelError as exc:
        path = "model.args" if "args" in str(exc) else where
        return None, [_issue(source, path, str(exc))]
    issues = []
    if task == "lm" and "seq_len" not in spec.args and workload.data.builtin == "pytext":
        issues.append(
            _issue(source, "model.args", "a language model on 'pytext' needs args.seq_len")
        )
    return task, issues


def check_storage(workload: Workload, source: Source) -> list[SpecIssue]:
    storage = workload.checkpoint.storage
    if "://" in storage:
        return []
    probe = Path(storage).resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return [_issue(source, "checkpoint.storage", f"'{storage}' is not a directory")]
    import os

    if not os.access(probe, os.W_OK):
        return [_issue(source, "checkpoint.storage", f"'{storage}' is not writable")]
    return []


def run_checks(
    workload: Workload, source: Source, prepare_data: bool = False
) -> tuple[DataPlan | None, list[SpecIssue]]:
    issues = check_batches(workload, source) + check_storage(workload, source)
    task, model_issues = check_model(workload, source)
    issues += model_issues
    plan = None
    if task is not None:
        data = workload.data.model_dump(mode="json")
        try:
            plan = plan_data(data, workload.model.model_dump(), task, prepare_builtin=prepare_data)
        except DataError as exc:
            issues.append(_issue(source, exc.path, str(exc)))
    return plan, issues
