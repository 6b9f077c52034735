"""The end of a run: the final weights as an MLflow model anyone can load, optionally registered.

- Built-in and user models: MLflow's pytorch flavour, saved with `torch.export`
  (MLflow 3's default, "pt2"): a self-contained graph that loads without shoal or
  the user's code. torch.export fixes every dimension of the input example unless
  the signature marks it -1, and fixes a size-1 dimension anyway, so the example
  is 2 rows (of 8 tokens for language models) and the signature's batch and
  sequence dimensions are -1: the model then takes any batch size and length.
  A model that torch.export cannot trace is saved with pickle instead (it then
  needs its code importable where it is loaded); the tag `shoal.model_format` says
  which. The pytorch flavour's `predict` wants one tensor out: a model returning
  a dict or a Hugging Face `ModelOutput` is wrapped to return its logits.
- Hugging Face models with a tokenizer: the transformers flavour
  (text-generation), with explicit pip requirements (else MLflow imports
  torchvision, which fails beside the CPU torch) and `max_new_tokens` within the
  model's positions (MLflow's default 256 overruns a small model).
- `tracking.register: {name, alias}` registers the logged model as a new version
  of NAME and points ALIAS at it: `mlflow.pytorch.load_model("models:/NAME@ALIAS")`.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pyarrow.parquet as pq
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import Schema, TensorSpec
from torch import nn

from shoal.models.outputs import unpack_outputs
from shoal.spec import LoadedWorkload
from shoal.spec.schema import RegisterSpec, Workload
from shoal.tracking.mlflow_run import TrackingError, tracking_errors
from shoal.worker.checkpoint.consolidate import consolidate, consolidated_model

log = logging.getLogger("shoal")
MODEL_NAME = "model"  # the logged model's name in its run (runs:/RUN_ID/model)
EXAMPLE_ROWS, EXAMPLE_TOKENS = 2, 8  # > 1 each: torch.export fixes size-1 dimensions
FORMAT_TAG = "shoal.model_format"
URI_TAG = "shoal.model_uri"
TOKENIZER_DIR = "tokenizer"  # a run's tokenizer: in its local run directory, and an MLflow artifact


class LogitsOnly(nn.Module):
    """A model whose forward returns a mapping (dict, HF ModelOutput), returning its logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return unpack_outputs(self.model(inputs)).logits


@dataclass
class LoggedModel:
    uri: str  # models:/NAME@ALIAS when registered with an alias, else models:/NAME/VERSION or runs:/
    flavor: str  # pytorch | transformers
    serialization: str  # pt2 | pickle | transformers
    version: str | None = None  # the registered version


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence a language model takes, when it says so."""
    config = getattr(model, "config", None)
    for source, name in ((model, "seq_len"), (config, "n_positions"), (config, "max_position_embeddings")):
        value = getattr(source, name, None)
        if isinstance(value, int):
            return value
    return None


def vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError(f"{type(model).__name__} has no token embedding to size an example from")
    return embedding.num_embeddings


def token_example(model: nn.Module) -> torch.Tensor:
    """Token ids for a language model: EXAMPLE_ROWS x EXAMPLE_TOKENS (fewer if it takes fewer)."""
    length = min(EXAMPLE_TOKENS, max_positions(model) or EXAMPLE_TOKENS)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size(model), (EXAMPLE_ROWS, max(2, length)), generator=generator)


def feature_example(train_files: list[str], column: str = "x") -> torch.Tensor | None:
    """The first rows of a classifier's input column in the (local) training data."""
    if not train_files or "://" in train_files[0] or column not in pq.read_schema(train_files[0]).names:
        return None
    table = pq.ParquetFile(train_files[0]).read_row_group(0, columns=[column]).slice(0, EXAMPLE_ROWS)
    rows = np.asarray(table.column(column).to_pylist(), dtype=np.float32)
    return torch.from_numpy(rows) if len(rows) == EXAMPLE_ROWS else None


def _signature(example: torch.Tensor, output: torch.Tensor, sequence: bool) -> ModelSignature:
    """Batch (and, for sequences, length) dimensions -1; the rest as in the example."""
    free = 2 if sequence else 1
    inputs = (-1,) * free + tuple(example.shape[free:])
    outputs = (-1,) * free + tuple(output.shape[free:])
    return ModelSignature(
        inputs=Schema([TensorSpec(example.numpy().dtype, inputs)]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), outputs)]),
    )


def _requirement(package: str) -> str:
    try:
        return f"{package}=={version(package).split('+')[0]}"
    except PackageNotFoundError:
        return package


@contextmanager
def using_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (log_model, register_model) against `uri` (the registry follows it
    unless one is set apart); the process's tracking URI restored after."""
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)


@contextmanager
def active_run(uri: str, run_id: str) -> Iterator[None]:
    """The run as MLflow's active run, against `uri`."""
    with using_uri(uri), mlflow.start_run(run_id=run_id):
        yield


def _pytorch(model: nn.Module, example: torch.Tensor | None, sequence: bool, registered: str | None) -> Any:
    """mlflow.pytorch.log_model: pt2 with a -1 signature, else pickle; returns (info, format)."""
    common = {
        "name": MODEL_NAME,
        "registered_model_name": registered,
        "pip_requirements": [_requirement("torch")],
    }
    if example is not None:
        with torch.no_grad():
            output = model(example)
        if not isinstance(output, torch.Tensor):
            model = LogitsOnly(model)
            output = model(example)
        signature = _signature(example, output.float(), sequence)
        try:
            info = mlflow.pytorch.log_model(
                model,
                input_example=example.numpy(),
                signature=signature,
                serialization_format="pt2",
                **common,
            )
            return info, "pt2"
        except MlflowException:
            raise  # the store's or registry's answer: pickling would not change it
        except Exception as exc:  # torch.export refuses many kinds of Python code; pickle takes any
            log.warning("torch.export cannot trace %s (%s); saving with pickle", type(model).__name__, exc)
        return mlflow.pytorch.log_model(
            model, input_example=example.numpy(), signature=signature, serialization_format="pickle", **common
        ), "pickle"
    return mlflow.pytorch.log_model(model, serialization_format="pickle", **common), "pickle"


def generation_tokens(model: nn.Module) -> int:
    """max_new_tokens for the transformers flavour: within the model's positions."""
    return max(1, min(32, (max_positions(model) or 64) // 2))


def _transformers(model: nn.Module, tokenizer: Any, registered: str | None) -> Any:
    packages = ("torch", "transformers", "tokenizers")
    return mlflow.transformers.log_model(
        {"model": model, "tokenizer": tokenizer},
        name=MODEL_NAME,
        task="text-generation",
        pip_requirements=[_requirement(p) for p in packages],
        model_config={"max_new_tokens": generation_tokens(model)},
        input_example=["hello"],
        registered_model_name=registered,
    )


def log_model(
    uri: str,
    run_id: str,
    model: nn.Module,
    example: torch.Tensor | None = None,
    sequence: bool = False,
    tokenizer: Any = None,
    register: RegisterSpec | None = None,
) -> LoggedModel:
    """Log `model` (on the CPU, in eval mode) in the run; register it when asked.

    `example`: a batch of the model's input (token ids when `sequence`), which sizes the
    signature; `tokenizer`: with a Hugging Face model, logs the transformers flavour.
    """
    registered = register.name if register else None
    model = model.cpu().eval()
    with tracking_errors(f"logging the model in MLflow run {run_id} at '{uri}'"), active_run(uri, run_id):
        if tokenizer is not None:
            info, flavor, serialization = (
                _transformers(model, tokenizer, registered),
                "transformers",
                "transformers",
            )
        else:
            info, serialization = _pytorch(model, example, sequence, registered)
            flavor = "pytorch"
        registered_version = info.registered_model_version
        version_text = None if registered_version is None else str(registered_version)
        logged = LoggedModel(info.model_uri, flavor, serialization, version_text)
        if register and logged.version is not None:
            logged.uri = f"models:/{register.name}/{logged.version}"
            if register.alias:
                client = MlflowClient(tracking_uri=uri)
                client.set_registered_model_alias(register.name, register.alias, logged.version)
                logged.uri = f"models:/{register.name}@{register.alias}"
        mlflow.set_tags({FORMAT_TAG: serialization, URI_TAG: logged.uri})
    return logged


def hf_tokenizer(workload: Workload, folder: Path | None) -> Any:
    """The tokenizer a Hugging Face model trained with, as a transformers tokenizer, or None:
    the run's saved one (`folder`: `tokenizer.json` + its config, for the hf and train_bpe
    kinds), else the workload's `tokenizer.path` (kind hf)."""
    spec = workload.tokenizer
    if workload.model.hf is None or spec is None:
        return None
    if folder is not None and (folder / "tokenizer.json").is_file():
        source = folder
    elif spec.type == "hf" and spec.path is not None:
        source = Path(spec.path)
    else:
        return None  # byte and tiktoken tokenizers are not transformers tokenizers
    # deferred: transformers is an optional library (shoal[hf]) and takes seconds to import
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source.is_dir():
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    return PreTrainedTokenizerFast(tokenizer_file=str(source))


def recorded_tokenizer(workload: Workload, uri: str, run_id: str) -> Any:
    """`hf_tokenizer` from the tokenizer a run logged as an MLflow artifact (TOKENIZER_DIR)."""
    if workload.model.hf is None or workload.tokenizer is None:
        return None
    with tempfile.TemporaryDirectory(prefix="shoal-tokenizer-") as tmp:
        try:
            folder = MlflowClient(tracking_uri=uri).download_artifacts(run_id, TOKENIZER_DIR, tmp)
        except (MlflowException, OSError):
            folder = None  # none logged: the workload's own path, if any
        return hf_tokenizer(workload, Path(folder) if folder else None)


def model_example(
    model: nn.Module, workload: Workload, task: str, train_files: list[str]
) -> tuple[torch.Tensor | None, bool]:
    """An input example for the pytorch flavour, and whether its second dimension is a sequence.
    Hugging Face models take token ids whatever their task (`custom`: their own loss)."""
    if task == "lm" or workload.model.hf is not None:
        return token_example(model), True
    if task == "classify":  # the data column that feeds the forward's `x` (data.columns)
        column = next((c for c, arg in workload.data.columns.items() if arg == "x"), "x")
        return feature_example(train_files, column), False
    return None, False  # a custom model's inputs are its own: logged without a signature


def log_final_model(
    uri: str,
    run_id: str,
    loaded: LoadedWorkload,
    filesystem: Any,
    run_path: str,
    register: RegisterSpec | None = None,
    tokenizer_dir: Path | None = None,
) -> LoggedModel:
    """The run's newest checkpoint, consolidated, logged (and registered) in its MLflow run;
    `tokenizer_dir`: where the run keeps its tokenizer."""
    workload = loaded.workload
    model = consolidated_model(workload, consolidate(filesystem, run_path))
    tokenizer = hf_tokenizer(workload, tokenizer_dir)
    task = loaded.data.task if loaded.data else ""
    example, sequence = model_example(model, workload, task, loaded.data.train if loaded.data else [])
    return log_model(uri, run_id, model, example, sequence, tokenizer, register)


def register_run_model(uri: str, run_id: str, register: RegisterSpec) -> str:
    """Register the model a run logged (a sweep's best trial) and point the alias at it."""
    client = MlflowClient(tracking_uri=uri)
    with tracking_errors(f"registering the model of MLflow run {run_id} at '{uri}'"):
        logged = client.get_run(run_id).data.tags.get(URI_TAG)
        if logged is None:
            raise TrackingError(f"MLflow run {run_id} logged no model (tracking.log_model)")
        with using_uri(uri):
            version = mlflow.register_model(logged, register.name).version
        if register.alias:
            client.set_registered_model_alias(register.name, register.alias, version)
            return f"models:/{register.name}@{register.alias}"
    return f"models:/{register.name}/{version}"
