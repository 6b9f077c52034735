"""shoal's Python API, for notebooks and scripts; the `shoal` command is built on it.

    import shoal

    result = shoal.run("workloads/quickstart.yaml", overrides=["train.max_steps=50"])
    result.model_uri                        # the final model in MLflow
    shoal.export(result.run_id, "out/")     # a state dict + the workload that rebuilds it
    model = shoal.load_export("out/")

Every function raises a `shoal.errors.ShoalError` subclass for bad input (the CLI
prints it and exits 2). Each imports the layer it needs when called: `import shoal`
itself loads neither torch nor Ray nor MLflow.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from shoal.errors import ShoalError

if TYPE_CHECKING:
    from torch import nn

    from shoal.launch import RunOptions, RunResult
    from shoal.launch.tuning import SweepResult
    from shoal.spec import LoadedWorkload
    from shoal.tracking import Observer

EXPORT_FORMATS = ("torch", "hf")
STATE_FILE = "model.pt"  # torch export: the consolidated state dict
WORKLOAD_FILE = "workload.yaml"  # the resolved workload that rebuilds the model
EXPORT_INFO = "export.json"  # which run, checkpoint and step it came from


class ExportError(ShoalError):
    """An export that cannot be made as asked; the message says why."""


def load_workload(
    workload: str | Path | Mapping[str, Any] | LoadedWorkload,
    overrides: Sequence[str] = (),
    prepare_data: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> LoadedWorkload:
    """A workload YAML file (or the same as a dict), with `--set`-style overrides, validated and
    checked as `shoal validate` does. With `prepare_data`, a built-in corpus is prepared now
    and raw text tokenized and packed (`on_progress` hears what happens)."""
    # deferred: the spec layer imports torch (model checks); `import shoal` stays light
    from shoal.spec import LoadedWorkload, load

    if isinstance(workload, LoadedWorkload):
        if overrides:
            raise ShoalError("overrides apply to a workload file or dict, not to a loaded workload")
        return workload
    return load(workload, list(overrides), prepare_data=prepare_data, on_progress=on_progress)


def run(
    workload: str | Path | Mapping[str, Any] | LoadedWorkload,
    overrides: Sequence[str] = (),
    address: str | None = None,
    *,
    run_name: str | None = None,
    verbose: bool = False,
    observer: Observer | None = None,
    options: RunOptions | None = None,
) -> RunResult:
    """Train a workload to its end (`shoal run`): a local Ray, or the cluster at `address`.

    A run name that has checkpoints resumes from the newest. The result says how it ended
    (`result.ok`, `result.reason`), its metrics, MLflow run id and `model_uri`. `observer`
    receives its progress (the CLI's terminal view is one); `options` holds the rest of
    `shoal.launch.RunOptions`.
    """
    # deferred: the launch layer imports Ray, torch and MLflow (seconds)
    from dataclasses import replace

    from shoal.launch import RunOptions
    from shoal.launch import run as launch_run

    loaded = load_workload(workload, overrides, prepare_data=True)
    chosen = options or RunOptions()
    chosen = replace(
        chosen,
        address=address or chosen.address,
        run_name=run_name or chosen.run_name,
        verbose=verbose or chosen.verbose,
    )
    return launch_run(loaded, chosen, observer)


@contextmanager
def _as_file(workload: str | Path | Mapping[str, Any] | LoadedWorkload) -> Iterator[Any]:
    """A sweep reads its workload file again to write the best configuration: a dict is written
    to a temporary file for the sweep's duration."""
    if not isinstance(workload, Mapping):
        yield workload
        return
    with tempfile.TemporaryDirectory(prefix="shoal-sweep-") as tmp:
        path = Path(tmp) / f"{workload.get('name', 'workload')}.yaml"
        path.write_text(yaml.safe_dump(dict(workload), sort_keys=False))
        yield path


def sweep(
    workload: str | Path | Mapping[str, Any] | LoadedWorkload,
    overrides: Sequence[str] = (),
    address: str | None = None,
    *,
    name: str | None = None,
    resume: bool = False,
    verbose: bool = False,
) -> SweepResult:
    """Search the workload's `sweep` section with Ray Tune (`shoal sweep`), one shoal run per
    trial. With `tracking.register`, the best trial's model is registered at the end
    (`result.model_uri`)."""
    # deferred: the launch layer imports Ray, torch and MLflow (seconds)
    from shoal.launch.sweep import SweepOptions
    from shoal.launch.sweep import sweep as launch_sweep

    with _as_file(workload) as source:
        loaded = load_workload(source, overrides, prepare_data=True)
        if loaded.workload.sweep is None:
            raise ShoalError(f"{loaded.source.file}: no 'sweep' section (see README, 'Sweeps')")
        if not Path(loaded.source.file).is_file():  # the best configuration is written from it
            raise ShoalError("a sweep takes its workload as a file or a dict, not one loaded from a dict")
        result = launch_sweep(
            loaded, SweepOptions(address=address, name=name, resume=resume, verbose=verbose)
        )
    register = loaded.workload.tracking.register_
    if register and result.best and result.best.run_id and loaded.workload.tracking.log_model:
        # deferred: MLflow (seconds), only when a model is registered
        from shoal.tracking.model_log import register_run_model

        result.model_uri = register_run_model(result.tracking_uri, result.best.run_id, register)
    return result


@dataclass
class ExportResult:
    directory: str
    format: str  # torch | hf
    run_id: str
    run_name: str
    step: int
    checkpoint: str
    files: list[str]


@contextmanager
def _on_path(directory: str | None) -> Iterator[None]:
    """A recorded run's working directory importable, where its user model modules live."""
    added = bool(directory) and directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        if added:
            sys.path.remove(directory)


def export(
    run: str,
    directory: str | Path,
    format: str = "torch",
    step: int | None = None,
    tracking_uri: str | None = None,
) -> ExportResult:
    """A consolidated model from a checkpoint (default: the newest) of a recorded run.

    `run`: an MLflow run id or a shoal run name (the newest run of that name).
    torch: `model.pt` (the full state dict) and `workload.yaml` (`load_export` rebuilds it);
    hf: a `save_pretrained` folder (and the tokenizer the run trained with), for models
    built from `model.hf` only.
    """
    # deferred: consolidation imports torch, the run's record MLflow (seconds)
    import torch

    from shoal.launch.storage import open_storage
    from shoal.tracking import resolve_uri
    from shoal.tracking.browse import run_details
    from shoal.tracking.mlflow_run import recorded_job
    from shoal.worker.checkpoint.consolidate import consolidate, consolidated_model

    if format not in EXPORT_FORMATS:
        raise ExportError(f"--format must be one of {', '.join(EXPORT_FORMATS)} (got {format!r})")
    uri = resolve_uri(tracking_uri)
    details = run_details(uri, run)
    job = recorded_job(uri, details.run.info.run_id)
    workload = _recorded_workload(job.spec_yaml, f"workload.yaml of MLflow run {job.run_id}")
    if format == "hf" and workload.model.hf is None:
        source = "family" if workload.model.family else "target"
        raise ExportError(
            f"run {job.run_name}: --format hf needs a Hugging Face model (model.hf); this run's model is "
            f"model.{source} {workload.model.family or workload.model.target}: use --format torch"
        )
    root, name = job.run_dir.rsplit("/", 1)
    storage = open_storage(root, details.run.data.params.get("checkpoint.endpoint") or None)
    consolidated = consolidate(storage.filesystem, storage.run_path(name), step)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    if format == "torch":
        torch.save(consolidated.state_dict, target / STATE_FILE)
        (target / WORKLOAD_FILE).write_text(yaml.safe_dump(workload.resolved(), sort_keys=False))
    else:
        with _on_path(job.cwd):
            model = consolidated_model(workload, consolidated)
        _save_hf(model, workload, uri, job.run_id, target)
    info = {"run_id": job.run_id, "run_name": job.run_name, "step": consolidated.step}
    (target / EXPORT_INFO).write_text(json.dumps({**info, "checkpoint": consolidated.checkpoint}, indent=1))
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    return ExportResult(
        str(target), format, job.run_id, job.run_name, consolidated.step, consolidated.checkpoint, files
    )


def _recorded_workload(spec_yaml: str, where: str) -> Any:
    """A recorded workload, validated (its data need not exist any more)."""
    # deferred: the spec layer imports torch (model checks); `import shoal` stays light
    from shoal.spec.loader import parse_workload_text, validate_data

    return validate_data(*parse_workload_text(spec_yaml, where))


def _save_hf(model: nn.Module, workload: Any, uri: str, run_id: str, target: Path) -> None:
    # deferred: transformers (seconds), only for this format
    from shoal.tracking.model_log import recorded_tokenizer

    model.save_pretrained(target)
    tokenizer = recorded_tokenizer(workload, uri, run_id)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)


def load_export(directory: str | Path) -> nn.Module:
    """The model of a torch export (`shoal export --format torch`), rebuilt and loaded, in eval mode."""
    # deferred: torch and the model registry (seconds)
    import torch

    from shoal.models import build_model
    from shoal.worker.checkpoint.consolidate import load_weights

    folder = Path(directory)
    if not (folder / STATE_FILE).is_file() or not (folder / WORKLOAD_FILE).is_file():
        raise ExportError(f"{folder} is not a torch export (needs {STATE_FILE} and {WORKLOAD_FILE})")
    workload = _recorded_workload((folder / WORKLOAD_FILE).read_text(), str(folder / WORKLOAD_FILE))
    model = build_model(workload.model.model_dump())
    state = torch.load(folder / STATE_FILE, weights_only=True)
    return load_weights(model, state, str(folder))
