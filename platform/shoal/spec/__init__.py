"""The workload spec: schema, YAML loading, `--set` overrides, pre-launch checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.data import DataPlan
from shoal.spec.checks import run_checks
from shoal.spec.loader import (
    Source,
    SpecError,
    SpecIssue,
    apply_overrides,
    read_yaml,
    validate_data,
)
from shoal.spec.schema import Workload


@dataclass
class LoadedWorkload:
    workload: Workload
    source: Source
    data: DataPlan | None


def load(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), prepare_data: bool = False
) -> LoadedWorkload:
    """Read, override, validate and check a workload; raises SpecError listing every problem.

    With `prepare_data`, a built-in corpus the workload names is prepared now.
    """
    raw, source = read_yaml(path)
    apply_overrides(raw, list(overrides), source)
    workload = validate_data(raw, source)
    plan, issues = run_checks(workload, source, prepare_data=prepare_data)
    if issues:
        raise SpecError(issues)
    return LoadedWorkload(workload, source, plan)


__all__ = ["LoadedWorkload", "SpecError", "SpecIssue", "Workload", "load"]
