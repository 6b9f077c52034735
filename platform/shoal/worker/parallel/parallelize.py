"""One function applies every parallelism to a model, always in this order:
tensor parallel -> activation checkpointing -> compile -> FSDP (or DDP).

Tensor parallelism shards the GPT's attention and MLP projections (Megatron
style: q/k/v and up are column-wise, out and down row-wise); embeddings, norms
and the head stay replicated. FSDP wraps each block, then the root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def tensor_parallel_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tensor_parallel_plan()
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)


def _blocks(model: nn.Module) -> dict[str, nn.Module] | None:
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, nn.ModuleDict) else None


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """full: every block recomputes its activations in backward; selective: every other block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _blocks(model)
    if mode == "none" or blocks is None:
        return
    for index, (name, block) in enumerate(list(blocks.items())):
        if mode == "full" or index % 2 == 0:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module, cache_dir: str | None) -> None:
    """torch.compile each block in place (names unchanged, so checkpoints still match)."""
    import os

    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        # Set, not setdefault: inductor writes its default into the environment on first use.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    blocks = _blocks(model)
    for block in blocks.values() if blocks is not None else [model]:
        block.compile()


def apply_fsdp(model: nn.Module, dp_mesh: Any, param_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = _blocks(model)
    for block in blocks.values() if blocks is not None else []:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
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
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    return model
