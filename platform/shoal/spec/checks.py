"""Checks that span sections or look outside the spec (model classes, data files).

Each returns SpecIssues naming the path at fault; `shoal validate` runs them all
before anything is launched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shoal.data.sources import DataPlan, builtin_shapes, column_shapes, window_length
from shoal.degrees import DegreeError, Degrees
from shoal.messages import VAL_PREFIX, Metric, model_metric_problem
from shoal.models import ModelError, ParallelModel, check_args, model_class, model_task
from shoal.models.cost import meta_batch
from shoal.models.objective import ForwardSignature, Objective
from shoal.models.registry import build_model, hf_models, import_loss, model_config
from shoal.spec.loader import Source, SpecIssue
from shoal.spec.schema import Workload

VALUE_METRICS = (
    Metric.TRAIN_LOSS,
    Metric.VAL_LOSS,
    Metric.VAL_ACCURACY,
)  # what keep_best and sweeps may compare
BYTE_VOCAB = 256  # the token ids of the built-in 'pytext' corpus are bytes


def _issue(source: Source, path: str, message: str) -> SpecIssue:
    return SpecIssue(source.where(path), path, message)


def check_batches(workload: Workload, source: Source) -> list[SpecIssue]:
    """The global batch stays the same at every world size the run may have: each one must
    split it into whole micro-batches per worker."""
    micro = workload.data.batch_size
    low, high = workload.scaling.worker_range()
    wanted = workload.train.global_batch_size or micro * high
    bad = [world for world in range(low, high + 1) if wanted % (micro * world)]
    if not bad:
        return []
    path = "train.global_batch_size" if workload.train.global_batch_size else "scaling.workers"
    elastic = f" (the global batch is kept at every worker count in {low}..{high})" if low < high else ""
    return [
        _issue(
            source,
            path,
            f"{wanted} is not a multiple of data.batch_size ({micro}) x {bad[0]} workers "
            f"= {micro * bad[0]}; accumulation needs a whole number of micro-batches{elastic}",
        )
    ]


def check_checkpoint(workload: Workload, source: Source) -> list[SpecIssue]:
    best, every = workload.checkpoint.keep_best, workload.checkpoint.every_steps
    if best is None:
        return []
    if best.metric not in VALUE_METRICS:
        allowed = ", ".join(VALUE_METRICS)
        return [_issue(source, "checkpoint.keep_best.metric", f"'{best.metric}' is not one of {allowed}")]
    evals = workload.train.eval_every
    if best.metric.startswith(VAL_PREFIX) and every and (not evals or every % evals):
        return [
            _issue(
                source,
                "checkpoint.keep_best.metric",
                f"{best.metric} is measured every {evals or 'no'} steps, not at every checkpoint "
                f"(every {every} steps); make train.eval_every divide checkpoint.every_steps",
            )
        ]
    return []


def check_model(workload: Workload, source: Source) -> tuple[str | None, list[SpecIssue]]:
    """The model's task, or the issues that stop us knowing it."""
    spec = workload.model
    check = check_hf_model if spec.hf is not None else _check_module
    task, issues = check(workload, source)
    if task is not None and spec.loss is not None:
        try:
            import_loss(spec.loss)
        except ModelError as exc:
            issues.append(_issue(source, "model.loss", str(exc)))
    return task, issues


def _check_module(workload: Workload, source: Source) -> tuple[str | None, list[SpecIssue]]:
    """A built-in family or a user's `module:Class`: importable, its task, its args."""
    spec = workload.model
    where = "model.family" if spec.family is not None else "model.target"
    try:
        cls = model_class(spec.family, spec.target)
        task = model_task(cls, spec.task)
        check_args(cls, spec.args)
    except ModelError as exc:
        path = "model.args" if "args" in str(exc) else where
        return None, [_issue(source, path, str(exc))]
    return task, []


def check_hf_model(workload: Workload, source: Source) -> tuple[str | None, list[SpecIssue]]:
    """A Hugging Face model that builds from local files alone (models/hf.py), and its task.
    A relative model.hf.path becomes absolute here, as data paths do: workers build from it."""
    spec = workload.model
    if spec.args:
        message = "a Hugging Face model takes its settings in model.hf.config"
        return None, [_issue(source, "model.args", message)]
    try:
        facts = hf_models().check_hf(spec.hf, spec.task)
    except ModelError as exc:
        return None, [_issue(source, exc.where or "model.hf", exc.message)]
    if spec.hf.path is not None:
        spec.hf.path = str(Path(spec.hf.path).expanduser().resolve())
    issues = []
    origin = "model.hf.config" if spec.hf.config is not None else "model.hf.path"
    if facts.task == "lm" and workload.data.builtin == "pytext" and (facts.vocab_size or 0) < BYTE_VOCAB:
        message = f"vocab_size {facts.vocab_size} is smaller than the {BYTE_VOCAB} bytes of 'pytext'"
        issues.append(_issue(source, origin, message))
    seq_len = workload.data.seq_len
    if facts.task == "lm" and seq_len and facts.max_positions and seq_len > facts.max_positions:
        message = f"{seq_len} tokens is more than the model's {facts.max_positions} positions ({origin})"
        issues.append(_issue(source, "data.seq_len", message))
    return facts.task, issues


def check_parallel(workload: Workload, source: Source, task: str | None) -> list[SpecIssue]:
    """Degrees that fit the worker count, and a model and batch that can be split that way."""
    parallel = workload.parallel.model_dump()
    issues, resolved = [], []
    for world in sorted(set(workload.scaling.worker_range())):
        try:
            resolved.append(Degrees.resolve(parallel, world))
        except DegreeError as exc:
            issues.append(_issue(source, "parallel", f"{exc} (scaling.workers: {world})"))
    if issues or task is None:
        return issues
    return [_issue(source, path, message) for path, message in _split_problems(workload, resolved)]


def _split_problems(workload: Workload, resolved: list[Degrees]) -> list[tuple[str, str]]:
    """The model's own objections to the largest tp and pp degrees, then the pipeline's."""
    model = workload.model
    tp, pp = max(d.tp for d in resolved), max(d.pp for d in resolved)
    if tp == 1 and pp == 1:
        return []
    cls = model_class(model.family, model.target, model.hf)
    if not issubclass(cls, ParallelModel):
        name = model.family or model.target or cls.__name__
        return [("parallel", f"model '{name}' supports ddp, fsdp and hsdp only (tp={tp}, pp={pp})")]
    stages = max(d.pipeline_stages(workload.parallel.pp_schedule) for d in resolved)
    args = model.args if model.hf is None else hf_models().parallel_args(model.hf)
    return cls.parallel_problems(args, tp, stages) + _pipeline_problems(workload, tp, pp, stages)


def _pipeline_problems(workload: Workload, tp: int, pp: int, stages: int) -> list[tuple[str, str]]:
    parallel, train = workload.parallel, workload.train
    if pp == 1:
        return []
    problems = []
    microbatches = parallel.microbatches or stages
    rows = workload.data.batch_size * tp * pp
    if rows % microbatches:
        problems.append(
            (
                "parallel.microbatches",
                f"{microbatches} does not divide the pipeline batch of "
                f"{rows} rows (data.batch_size x tp x pp)",
            )
        )
    if microbatches < stages and parallel.pp_schedule != "gpipe":
        problems.append(
            (
                "parallel.microbatches",
                f"{parallel.pp_schedule} needs at least as many microbatches as stages ({stages})",
            )
        )
    if train.precision == "fp16":
        problems.append(
            ("train.precision", "fp16 loss scaling is not supported with pipeline parallelism; use bf16")
        )
    return problems


def check_precision(workload: Workload, source: Source) -> list[SpecIssue]:
    if workload.train.precision == "fp8" and not workload.scaling.gpus_per_worker:
        return [
            _issue(
                source,
                "train.precision",
                "fp8 needs CUDA GPUs of capability >= 8.9 (Ada, Hopper or "
                "newer); scaling.gpus_per_worker is 0",
            )
        ]
    return []


def check_storage(workload: Workload, source: Source) -> list[SpecIssue]:
    storage, endpoint = workload.checkpoint.storage, workload.checkpoint.endpoint
    if storage.startswith("s3://"):
        return []
    if "://" in storage:
        return [
            _issue(source, "checkpoint.storage", f"'{storage}' is neither a directory nor s3://bucket/prefix")
        ]
    if endpoint:
        return [
            _issue(
                source, "checkpoint.endpoint", f"'{endpoint}' is for s3:// storage (storage is '{storage}')"
            )
        ]
    probe = Path(storage).resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return [_issue(source, "checkpoint.storage", f"'{storage}' is not a directory")]
    if not os.access(probe, os.W_OK):
        return [_issue(source, "checkpoint.storage", f"'{storage}' is not writable")]
    return []


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
    built = _meta_model(workload)
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


def _meta_model(workload: Workload) -> Any:
    """The model built on the meta device, or None where that cannot be done."""
    hf = workload.model.hf
    if hf is not None and hf.path is not None:
        return None
    model = workload.model.model_dump()
    try:
        model = model_config(model, window_length(workload.data.seq_len, workload.model.args))
        with torch.device("meta"):
            return build_model(model)
    except Exception:  # noqa: BLE001 - any failure means: not checkable on meta
        return None


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
        if isinstance(exc, NotImplementedError) or "meta" in str(exc).lower():
            return []  # the meta device's limit, not the model's
        described = ", ".join(f"{k}: {d}{[rows, *s]}" for k, (s, d) in shapes.items())
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [
            (
                "model",
                f"one micro-batch ({described}) through the model and loss on the meta device "
                f"failed: {type(exc).__name__}: {first_line}",
            )
        ]
    return [
        ("model", problem)
        for name in result.metrics
        if (problem := model_metric_problem(name, objective.task)) is not None
    ]
