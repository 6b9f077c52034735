"""Checkpoint save/restore: model and optimizer through torch.distributed.checkpoint
(sharded, so the same code serves DDP now and FSDP/TP later), plus the trainer
state (step, data position, scheduler) and every rank's RNG states.

Each rank writes into its own temporary directory and reports it; Ray Train
merges the ranks' files into one checkpoint directory in storage.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

TRAINER_STATE = "trainer_state.json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Position:
    """Where training stands: optimizer steps done and the data read so far."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches this rank consumed in `epoch`
    samples: int = 0  # training samples consumed, all ranks together


def _rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fqn(flat_key: str) -> str:
    """'state.blocks.0.attn.q.weight.exp_avg' -> 'blocks.0.attn.q.weight'."""
    return flat_key.split(".", 1)[1].rpartition(".")[0]


def _states(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, dict]:
    """Model and (flattened) optimizer state of every part, keyed by the parameters' global names.

    Names are global (a pipeline stage keeps its layers' original names), so the
    parts' dicts merge by union and checkpoints reshard across layouts.
    """
    model, optim = {}, {}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, optimizer, options=_FLAT))
    return {"model": model, "optim": optim}


def save(
    directory: Path,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    position: Position,
    rank: int,
    world_size: int,
) -> None:
    dcp.save(_states(parts, optimizers), checkpoint_id=str(directory))
    torch.save(_rng_state(), directory / f"rng-rank{rank}.pt")
    if rank == 0:
        state = {"position": asdict(position), "world_size": world_size, "scheduler": scheduler.state_dict()}
        (directory / TRAINER_STATE).write_text(json.dumps(state))


def restore(
    directory: Path,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[torch.optim.lr_scheduler.LRScheduler],
    rank: int,
) -> tuple[Position, int]:
    """Load a checkpoint in place; returns the position and the world size that wrote it."""
    state = json.loads((directory / TRAINER_STATE).read_text())
    loaded = _states(parts, optimizers)
    dcp.load(loaded, checkpoint_id=str(directory))
    for part, optimizer in zip(parts, optimizers, strict=True):
        names = set(get_model_state_dict(part))
        set_model_state_dict(part, {k: v for k, v in loaded["model"].items() if k in names})
        own = {k: v for k, v in loaded["optim"].items() if _fqn(k) in names}
        set_optimizer_state_dict(part, optimizer, own, options=_FLAT)
    for scheduler in schedulers:
        scheduler.load_state_dict(state["scheduler"])
    rng_file = directory / f"rng-rank{rank}.pt"
    if rng_file.exists():  # absent when the world grew: the new rank keeps its fresh seed
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return Position(**state["position"]), state["world_size"]
