"""One function applies every parallelism to a model, always in this order:
tensor parallel -> activation checkpointing -> compile -> FSDP (or DDP).

Tensor parallelism follows the model's own plan (models/protocol.py's
ParallelModel). Activation checkpointing, compile and FSDP go block by block over
the model's repeated blocks (models/blocks.py: the GPT's `blocks`, a Hugging Face
model's `_no_split_modules` layers); FSDP wraps each block, then the root.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from shoal.models.blocks import repeated_blocks
from shoal.models.protocol import ParallelModel


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    if not isinstance(model, ParallelModel):
        raise TypeError(f"{type(model).__name__} has no tensor-parallel plan (models/protocol.py)")
    parallelize_module(model, tp_mesh, model.tensor_parallel_plan())


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """full: every block recomputes its activations in backward; selective: every other block.

    The wrapper takes the block's place under the same key; its state dict drops the
    wrapper's prefix, so checkpoints keep the block's parameter names."""
    if mode == "none":
        return
    for index, slot in enumerate(repeated_blocks(model)):
        if mode == "full" or index % 2 == 0:
            slot.replace(checkpoint_wrapper(slot.module, preserve_rng_state=False))


def apply_compile(model: nn.Module, cache_dir: str | None) -> None:
    """torch.compile each block in place (names unchanged, so checkpoints still match)."""
    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        # Set, not setdefault: inductor writes its default into the environment on first use.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    for block in [slot.module for slot in repeated_blocks(model)] or [model]:
        block.compile()


def apply_fsdp(model: nn.Module, dp_mesh: Any, param_dtype: torch.dtype | None) -> None:
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for slot in repeated_blocks(model):
        fully_shard(slot.module, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def parallelize(
    model: nn.Module,
    dims: Any,
    mesh: Any,
    device: torch.device,
    activation_checkpointing: str = "none",
    compile_model: bool = False,
    compile_cache: str | None = None,
    fsdp_param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model (or pipeline stage), ready to train under `dims`."""
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile_model:
        apply_compile(model, compile_cache)
    if dims.uses_fsdp:
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], fsdp_param_dtype)
    elif dims.uses_ddp:
        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    return model
