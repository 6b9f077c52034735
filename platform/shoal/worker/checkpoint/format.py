"""The checkpoint format: what one checkpoint directory holds and how it is read.

- `checkpoint-NNNNNNNN/` (the optimizer step, `checkpoint_name`), in the run's
  storage directory;
- model and optimizer through torch.distributed.checkpoint (sharded: DDP, FSDP,
  TP and pipeline stages alike, loadable at another world size);
- `trainer_state.json` (rank 0): the trainer's own state (`state.TrainingState`
  and the learning-rate schedule);
- `rng-rankN.pt`: every rank's RNG states;
- `manifest-rankN.json`: each rank seals what it wrote with sizes and CRC32s; a
  checkpoint missing a manifest or failing one is never resumed from.

Each rank writes into its own temporary directory and reports it; Ray Train
merges the ranks' files into one checkpoint directory in storage. When and how
checkpoints are taken is `saver.py`'s business.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
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

from shoal.worker.optim import kernel_flags, reapply_kernel

TRAINER_STATE = "trainer_state.json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


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
    """'state.encoder.0.weight.exp_avg' (an optimizer state key) -> 'encoder.0.weight'."""
    return flat_key.split(".", 1)[1].rpartition(".")[0]


def states(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, dict]:
    """Model and (flattened) optimizer state of every part, keyed by the parameters' global names.

    Names are global (a pipeline stage keeps its layers' original names), so the
    parts' dicts merge by union and checkpoints reshard across layouts.
    """
    model, optim = {}, {}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model.update(get_model_state_dict(part))
        optim.update(get_optimizer_state_dict(part, optimizer, options=_FLAT))
    return {"model": model, "optim": optim}


CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after optimizer step `step`."""
    return f"checkpoint-{step:08d}"


def checkpoint_steps(filesystem: Any, directory: str) -> dict[str, int]:
    """The checkpoint directories under a run directory (any pyarrow filesystem), name -> step."""
    infos = filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    found = {}
    for info in infos:
        match = CHECKPOINT_NAME.match(info.base_name)
        if match and info.type == pafs.FileType.Directory:
            found[info.base_name] = int(match.group(1))
    return found


def write_extras(directory: Path, rank: int, trainer_state: dict[str, Any] | None) -> None:
    """What DCP does not hold: this rank's RNG states, and (rank 0) the trainer state."""
    torch.save(_rng_state(), directory / f"rng-rank{rank}.pt")
    if trainer_state is not None:
        (directory / TRAINER_STATE).write_text(json.dumps(trainer_state))


def save(
    directory: Path,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    rank: int,
    trainer_state: dict[str, Any] | None,
) -> None:
    """Write and seal this rank's shard into `directory` (the whole synchronous save)."""
    write_extras(directory, rank, trainer_state)
    dcp.save(states(parts, optimizers), checkpoint_id=str(directory))
    seal(directory, rank)


def seal(directory: Path, rank: int) -> None:
    """Record size and CRC32 of every file this rank wrote: a checkpoint is complete only
    when every rank's manifest is present and matches (see `verify`)."""
    # Other ranks' manifests (and the temporary files they are written through) are theirs:
    # one may be renamed away while this rank lists the directory.
    written = [p for p in sorted(directory.iterdir()) if not p.name.startswith(("manifest", ".manifest"))]
    files = {p.name: _fingerprint(p) for p in written}
    tmp = directory / f".manifest-rank{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "files": files}))
    tmp.replace(directory / f"manifest-rank{rank}.json")


def _fingerprint(path: Path) -> list[int]:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return [path.stat().st_size, crc]


def verify(directory: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    state_file = directory / TRAINER_STATE
    if not state_file.exists():
        return f"{TRAINER_STATE} is missing"
    try:
        world = json.loads(state_file.read_text())["world_size"]
    except (ValueError, KeyError) as exc:
        return f"{TRAINER_STATE} is unreadable ({exc})"
    for rank in range(world):
        manifest = directory / f"manifest-rank{rank}.json"
        if not manifest.exists():
            return f"rank {rank} of {world} never finished writing (no {manifest.name})"
        for name, expected in json.loads(manifest.read_text())["files"].items():
            path = directory / name
            if not path.exists():
                return f"{name} is missing"
            if _fingerprint(path) != expected:
                return f"{name} does not match its manifest (size or CRC32 differ)"
    return None


def restore(
    directory: Path,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[torch.optim.lr_scheduler.LRScheduler],
    rank: int,
) -> tuple[dict[str, Any], bool]:
    """Load a checkpoint in place; returns the trainer state and whether this rank's RNG
    states were restored (a rank that did not exist when it was written keeps its own)."""
    state = json.loads((directory / TRAINER_STATE).read_text())
    loaded = states(parts, optimizers)
    dcp.load(loaded, checkpoint_id=str(directory))
    for part, optimizer in zip(parts, optimizers, strict=True):
        names = set(get_model_state_dict(part))
        set_model_state_dict(part, {k: v for k, v in loaded["model"].items() if k in names})
        own = {k: v for k, v in loaded["optim"].items() if _fqn(k) in names}
        kernel = kernel_flags(optimizer)
        set_optimizer_state_dict(part, optimizer, own, options=_FLAT)
        reapply_kernel(optimizer, kernel)
    for scheduler in schedulers:
        scheduler.load_state_dict(state["scheduler"])
    rng_file = directory / f"rng-rank{rank}.pt"
    if rng_file.exists() and state["world_size"] > rank:
        _set_rng_state(torch.load(rng_file, weights_only=False))
        return state, True
    return state, False
