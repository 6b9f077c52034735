"""A checkpoint's model weights as one full state dict, in one process, without a process group.

DCP records every tensor's global size and where each shard lives, whatever the
layout that wrote it (DDP, FSDP, TP, pipeline stages, at any world size), so one
process can read the whole model back: `dcp.load(..., no_dist=True)` into
full-size tensors made from the checkpoint's metadata. Only the model's entries
are read; the optimizer state stays on disk.

Checkpoints in object storage are copied into a local temporary directory first
(through the same pyarrow filesystem that lists them), then read the same way.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shoal.errors import ShoalError
from shoal.models import build_model
from shoal.spec.schema import Workload
from shoal.worker.checkpoint.format import checkpoint_name, checkpoint_steps, verify

MODEL_PREFIX = "model."  # format.save writes {"model": ..., "optim": ...}; DCP flattens with dots


class CheckpointError(ShoalError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


@dataclass
class Consolidated:
    step: int
    checkpoint: str  # the checkpoint directory as its filesystem names it
    state_dict: dict[str, torch.Tensor]


def checkpoint_path(filesystem: Any, run_path: str, step: int | None = None) -> tuple[str, int]:
    """The directory of the run's checkpoint at `step` (default: the newest), and its step."""
    found = checkpoint_steps(filesystem, run_path)
    if not found:
        raise CheckpointError(f"no checkpoints under {run_path}")
    if step is None:
        name = max(found, key=found.get)
        return f"{run_path}/{name}", found[name]
    if checkpoint_name(step) not in found:
        steps = ", ".join(str(s) for s in sorted(found.values()))
        raise CheckpointError(f"no checkpoint at step {step} under {run_path} (steps: {steps})")
    return f"{run_path}/{checkpoint_name(step)}", step


@contextmanager
def local_copy(filesystem: Any, directory: str) -> Iterator[Path]:
    """The checkpoint as a local directory: itself when local, else a temporary copy."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        yield Path(directory)
        return
    with tempfile.TemporaryDirectory(prefix="shoal-ckpt-") as tmp:
        pafs.copy_files(
            directory,
            tmp,
            source_filesystem=filesystem,
            destination_filesystem=pafs.LocalFileSystem(),
        )
        yield Path(tmp)


def read_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a local checkpoint directory (CPU tensors)."""
    problem = verify(directory)
    if problem:
        raise CheckpointError(f"checkpoint {directory} is incomplete: {problem}")
    reader = dcp.FileSystemReader(str(directory))
    entries = reader.read_metadata().state_dict_metadata
    template = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    if not template:
        raise CheckpointError(f"checkpoint {directory} holds no model weights")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    return {key.removeprefix(MODEL_PREFIX): tensor for key, tensor in template.items()}


def consolidate(filesystem: Any, run_path: str, step: int | None = None) -> Consolidated:
    """One full state dict from a run's checkpoint (default: the newest), on any filesystem."""
    directory, found_step = checkpoint_path(filesystem, run_path, step)
    with local_copy(filesystem, directory) as local:
        state = read_model_state(local)
    return Consolidated(found_step, directory, state)


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> nn.Module:
    """Put consolidated weights into a freshly built model: every entry must fit."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {where} does not fit the workload's model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state_dict)
    return model.eval()


def consolidated_model(workload: Workload, consolidated: Consolidated) -> nn.Module:
    """The workload's model, built on the CPU, holding the checkpoint's weights."""
    model = build_model(workload.model.model_dump())
    return load_weights(model, consolidated.state_dict, consolidated.checkpoint)
