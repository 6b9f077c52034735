"""The workload spec: schema, YAML loading, `--set` overrides, pre-launch checks."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.data import DataError, DataPlan, plan_data
from shoal.spec.checks import (
    check_batches,
    check_checkpoint,
    check_data_sizes,
    check_model,
    check_parallel,
    check_precision,
    check_storage,
    check_vocab,
)
from shoal.spec.contract import check_contract
from shoal.spec.loader import (
    Source,
    SpecError,
    SpecIssue,
    apply_overrides,
    read_yaml,
    validate_data,
)
from shoal.spec.schema import Workload
from shoal.spec.sweep import check_sweep


@dataclass
class LoadedWorkload:
    workload: Workload
    source: Source
    data: DataPlan | None


def run_checks(
    workload: Workload,
    source: Source,
    prepare_data: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> tuple[DataPlan | None, list[SpecIssue]]:
    """Every check of spec/checks.py and spec/sweep.py, and the data plan when the model is known."""
    issues = check_batches(workload, source) + check_storage(workload, source)
    issues += check_checkpoint(workload, source) + check_sweep(workload, source)
    task, model_issues = check_model(workload, source)
    issues += model_issues + check_parallel(workload, source, task) + check_precision(workload, source)
    plan = None
    if task is not None:
        data = workload.data.model_dump(mode="json")
        tokenizer = workload.tokenizer.model_dump() if workload.tokenizer else None
        model = workload.model.model_dump()
        try:
            plan = plan_data(data, model, task, False, tokenizer)
            issues += check_vocab(workload, source, plan)
            if prepare_data and not issues:  # prepare (pack text: minutes) only a workload that can run
                plan = plan_data(data, model, task, True, tokenizer, on_progress)
            issues += check_data_sizes(workload, source, plan)
        except DataError as exc:
            issues.append(SpecIssue(source.where(exc.path), exc.path, str(exc)))
        issues += check_contract(workload, source, task, plan)
    return plan, issues


def load(
    path: str | Path | Mapping[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    prepare_data: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> LoadedWorkload:
    """Read (a YAML file, or the same content as a dict), override, validate and check a
    workload; raises SpecError listing every problem.

    With `prepare_data`, a built-in corpus the workload names is prepared now, raw text
    packed (`on_progress` hears what happens).
    """
    if isinstance(path, Mapping):
        raw, source = copy.deepcopy(dict(path)), Source("<workload dict>")
    else:
        raw, source = read_yaml(path)
    apply_overrides(raw, list(overrides), source)
    workload = validate_data(raw, source)
    plan, issues = run_checks(workload, source, prepare_data=prepare_data, on_progress=on_progress)
    if issues:
        raise SpecError(issues)
    return LoadedWorkload(workload, source, plan)


__all__ = ["LoadedWorkload", "SpecError", "SpecIssue", "Workload", "load"]
