"""Checks that span sections or look outside the spec (model classes, data files).

Each returns SpecIssues naming the path at fault; `shoal validate` runs them all
before anything is launched.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shoal.data.builtin import cache_dir, read_manifest
from shoal.data.sources import DataPlan, training_manifest, window_length
from shoal.degrees import DegreeError, Degrees, show_degrees
from shoal.messages import VAL_PREFIX, Metric
from shoal.models import ModelError, ParallelModel, check_args, model_class, model_task
from shoal.models.registry import hf_models, import_loss
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


def _rows_per_step(workload: Workload) -> int:
    """The global batch: `train.global_batch_size`, else data.batch_size x the most workers
    (worker/batching.py's rule; spec/ imports no worker/)."""
    return workload.train.global_batch_size or workload.data.batch_size * workload.scaling.worker_range()[1]


def check_batches(workload: Workload, source: Source) -> list[SpecIssue]:
    """The global batch stays the same at every world size the run may have: each one must
    split it into whole micro-batches per worker."""
    micro = workload.data.batch_size
    low, high = workload.scaling.worker_range()
    wanted = _rows_per_step(workload)
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
        path = exc.where or ("model.args" if "args" in str(exc) else where)
        return None, [_issue(source, path, exc.message)]
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
    if issues:
        return issues
    kernel = _optimizer_problems(workload, source, resolved)
    if task is None:
        return kernel
    return kernel + [_issue(source, path, message) for path, message in _split_problems(workload, resolved)]


def _optimizer_problems(workload: Workload, source: Source, resolved: list[Degrees]) -> list[SpecIssue]:
    """Kernels torch cannot run on the parameters these degrees make (worker/optim.py)."""
    optimizer, path = workload.train.optimizer, "train.optimizer.implementation"
    split = [d for d in resolved if d.tp > 1]
    if optimizer.implementation in ("fused", "foreach") and split:
        message = (
            f"{optimizer.implementation} steps every parameter of a group in one call, and with "
            f"{show_degrees(asdict(split[0]))} the tp-split layers and the rest sit on different "
            "device meshes (or none); use auto or for-loop"
        )
        return [_issue(source, path, message)]
    sharded = [d for d in resolved if d.uses_fsdp]
    if optimizer.name == "sgd" and optimizer.implementation == "fused" and sharded:
        message = (
            "torch has no fused SGD for sharded parameters "
            f"({show_degrees(asdict(sharded[0]))} shards them); use auto or foreach"
        )
        return [_issue(source, path, message)]
    return []


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


def _model_vocab(workload: Workload) -> tuple[str, int] | None:
    """(spec path, vocabulary size) of the model, where the spec or the model's defaults say it."""
    model = workload.model
    if "vocab_size" in model.args:
        return "model.args.vocab_size", int(model.args["vocab_size"])
    if model.hf is not None:
        if model.hf.config is not None:
            size = model.hf.config.get("vocab_size")
            return ("model.hf.config.vocab_size", int(size)) if size else None
        config = Path(model.hf.path or "") / "config.json"
        size = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
        return ("model.hf.path", int(size)) if size else None
    try:
        default: Any = (
            inspect.signature(model_class(model.family, model.target)).parameters["vocab_size"].default
        )
    except (ModelError, KeyError, TypeError, ValueError):
        return None
    return ("model.args.vocab_size", int(default)) if isinstance(default, int) else None


def check_vocab(workload: Workload, source: Source, plan: DataPlan | None) -> list[SpecIssue]:
    """A model whose embedding cannot hold every id the tokenizer gives (a larger one may pad)."""
    text = plan.text if plan else None
    model = _model_vocab(workload) if text else None
    if text is None or model is None or model[1] >= text.vocab_size:
        return []
    path, size = model
    kind = text.request.tokenizer.get("type", "byte")
    return [
        _issue(
            source,
            path,
            f"the model's vocabulary ({size}) is smaller than the tokenizer's ({text.vocab_size}, "
            f"{kind}): set it to at least {text.vocab_size}",
        )
    ]


def check_data_sizes(workload: Workload, source: Source, plan: DataPlan | None) -> list[SpecIssue]:
    """Batch sizes the training set can fill: one optimizer step takes the global batch
    (data.batch_size x workers x accumulation) of distinct rows from it. Only where the
    files are there to count (a built-in corpus is counted once it is prepared)."""
    if plan is None:
        return []
    rows = training_manifest(plan).total_rows if plan.train else _prepared_builtin_rows(workload)
    if rows is None:
        return []
    micro, high = workload.data.batch_size, workload.scaling.worker_range()[1]
    wanted = _rows_per_step(workload)
    if wanted <= rows:
        return []
    path = "train.global_batch_size" if workload.train.global_batch_size else "data.batch_size"
    origin = "data.builtin" if workload.data.builtin else "data.train.path"
    return [
        _issue(
            source,
            path,
            f"one step takes {wanted:,} rows (data.batch_size {micro} x up to {high} workers"
            f"{' x accumulation' if wanted > micro * high else ''}), more than the "
            f"{rows:,} rows of the training set ({origin})",
        )
    ]


def _prepared_builtin_rows(workload: Workload) -> int | None:
    """The training rows of a built-in corpus already prepared in the cache (None if not)."""
    if workload.data.builtin is None:
        return None
    seq_len = window_length(workload.data.seq_len, workload.model.args)
    prepared = read_manifest(cache_dir(workload.data.builtin, seq_len if isinstance(seq_len, int) else None))
    rows = (prepared or {}).get("rows", {}).get("train")
    return rows if isinstance(rows, int) else None
