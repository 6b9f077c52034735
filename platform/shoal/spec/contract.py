"""The data fits the model, checked before launch: columns against the forward's signature,
then one micro-batch through the model built on the meta device (models/objective.py)."""

from __future__ import annotations

from typing import Any

import torch

from shoal.data.sources import DataPlan, builtin_shapes, column_shapes, window_length
from shoal.degrees import DegreeError, Degrees
from shoal.messages import model_metric_problem
from shoal.models import ModelError, model_class
from shoal.models.cost import meta_batch
from shoal.models.objective import ForwardSignature, Objective
from shoal.models.registry import build_model, import_loss, model_config
from shoal.spec.loader import Source, SpecIssue
from shoal.spec.schema import Workload


def _issue(source: Source, path: str, message: str) -> SpecIssue:
    return SpecIssue(source.where(path), path, message)


def check_contract(
    workload: Workload, source: Source, task: str | None, plan: DataPlan | None
) -> list[SpecIssue]:
    """The data fits the model before anything launches.

    1. The data columns (the parquet schema of the first train file, or a built-in corpus's
       columns), mapped through data.columns, fit the forward's signature.
    2. One micro-batch of data.batch_size rows, shaped from the schema (one row read for
       the length of variable-length lists), runs through the model built on the meta
       device and the loss: an error there is one issue, not a worker traceback.

    Skipped where it cannot be done cheaply and truthfully: remote data files (no schema
    read), a model whose constructor or forward fails on meta for reasons of the meta
    device itself (NotImplementedError, `.item()`, data-dependent shapes: the real run may
    well work), and a model loaded from a folder (model.hf.path: its weights would be read).
    """
    if task is None or plan is None:
        return []
    issues = [_issue(source, path, message) for path, message in _pipeline_contract(workload, task)]
    shapes, where = _sample_columns(workload, plan)
    spec = workload.model
    built, build_problem = _meta_model(workload)
    if build_problem is not None:
        return [*issues, _issue(source, "model.args", build_problem)]
    if shapes is None or (built is None and spec.hf is not None):
        return issues  # no schema, or no class to read a signature from without loading the model
    try:
        cls = built if built is not None else model_class(spec.family, spec.target)
        loss_fn = import_loss(spec.loss) if spec.loss else None
    except ModelError:  # reported by check_model
        return issues
    objective = Objective(task, ForwardSignature.of(cls), dict(workload.data.columns), loss_fn)
    problems = _signature_problems(objective, list(shapes), where)
    if not problems and built is not None:
        problems = _meta_trace(workload, objective, built, shapes)
    return issues + [_issue(source, path, message) for path, message in problems]


def _pipeline_contract(workload: Workload, task: str) -> list[tuple[str, str]]:
    """Pipeline stages pass one tensor from stage to stage and end in next-token cross
    entropy: only the token-window language model fits."""
    if _largest_pp(workload) == 1:
        return []
    if task != "lm":
        return [("parallel", f"pipeline parallelism trains task lm only (the model's task is {task})")]
    if workload.model.loss is not None:
        return [("model.loss", "a custom loss is not supported with pipeline parallelism")]
    if len(workload.data.columns) > 1:
        return [("data.columns", "pipeline parallelism feeds the model one token column only")]
    return []


def _largest_pp(workload: Workload) -> int:
    largest = 1
    for world in set(workload.scaling.worker_range()):
        try:
            largest = max(largest, Degrees.resolve(workload.parallel.model_dump(), world).pp)
        except DegreeError:  # reported by check_parallel
            continue
    return largest


def _sample_columns(
    workload: Workload, plan: DataPlan
) -> tuple[dict[str, tuple[tuple[int, ...], str]] | None, str]:
    """One row's columns (shape, dtype) and where they come from; None for remote data."""
    data = workload.data
    if data.builtin is not None:
        seq_len = window_length(data.seq_len, workload.model.args)
        return builtin_shapes(data.builtin, seq_len), f"the '{data.builtin}' corpus"
    if plan.text is not None and not plan.text.train:  # raw text not packed yet: token windows
        return {"id": ((), "int64"), "tokens": ((plan.text.request.seq_len + 1,), "int64")}, "packed text"
    first = plan.train[0]
    if "://" in first and not first.startswith("file://"):
        return None, first
    try:
        return column_shapes(first.removeprefix("file://")), f"'{first}'"
    except Exception:  # unreadable: plan_data has said so
        return None, first


def _signature_problems(objective: Objective, available: list[str], where: str) -> list[tuple[str, str]]:
    signature, declared = objective.signature, objective.columns
    path = "data.columns" if declared else "data.train.path"
    shown = signature.describe()
    if objective.positional:
        if not (signature.names or signature.var_positional) or len(signature.required) > 1:
            return [("model", f"task {objective.task} calls the model with one tensor; it has {shown}")]
        return []
    problems = []
    feeds = objective.feeds(available)
    for column, argument in feeds.items():
        if not signature.takes(argument):
            problems.append((path, f"column '{column}' feeds '{argument}', which {shown} does not take"))
    fed = set(feeds.values())
    for argument in signature.required:
        if argument not in fed:
            mapping = f"data.columns maps {declared}" if declared else f"{where} has columns {available}"
            problems.append((path, f"{shown} needs '{argument}', which no data column feeds ({mapping})"))
    if objective.task == "classify" and objective.label_column() is None:
        problems.append(("data.columns", "task classify needs a label: map a column to 'labels' or 'y'"))
    return problems


def _meta_model(workload: Workload) -> tuple[Any, str | None]:
    """The model built on the meta device (None where that cannot be done), or the problem
    its constructor has with the given args."""
    hf = workload.model.hf
    if hf is not None and hf.path is not None:
        return None, None
    model = workload.model.model_dump()
    try:
        model = model_config(model, window_length(workload.data.seq_len, workload.model.args))
        with torch.device("meta"):
            return build_model(model), None
    except Exception as exc:  # noqa: BLE001 - the user's constructor may raise anything
        if _meta_limit(exc):
            return None, None  # not checkable on meta; the real run may well work
        return None, f"building the model failed: {_first_line(exc)}"


def _meta_limit(exc: BaseException) -> bool:
    """An error of the meta device itself (no data, no `.item()`), not of the model."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _meta_trace(
    workload: Workload, objective: Objective, model: Any, shapes: dict[str, tuple[tuple[int, ...], str]]
) -> list[tuple[str, str]]:
    rows = workload.data.batch_size
    batch = meta_batch({k: (shape, getattr(torch, dtype)) for k, (shape, dtype) in shapes.items()}, rows)
    try:
        result = objective.step(model, batch, torch.device("meta"))
    except ModelError as exc:
        return [("model.loss" if workload.model.loss else "model", str(exc))]
    except Exception as exc:  # noqa: BLE001 - the user's forward may raise anything
        if _meta_limit(exc):
            return []  # the meta device's limit, not the model's
        described = ", ".join(f"{k}: {d}{[rows, *s]}" for k, (s, d) in shapes.items())
        return [
            (
                "model",
                f"one micro-batch ({described}) through the model and loss on the meta device "
                f"failed: {_first_line(exc)}",
            )
        ]
    return [
        ("model", problem)
        for name in result.metrics
        if (problem := model_metric_problem(name, objective.task)) is not None
    ]
