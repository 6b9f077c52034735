"""What a model costs per sample, found by tracing one training step on the meta device.

The meta device allocates nothing and computes nothing, so this works for a
70B model on a laptop: FLOPs come from torch's FlopCounterMode, activation
bytes from the tensors autograd saves for the backward pass. Workers use it for
achieved FLOP/s; the planner (`shoal plan`) for memory estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from shoal.models.blocks import repeated_blocks
from shoal.models.objective import ForwardSignature, Objective
from shoal.models.registry import build_model

TRACE_BATCH = 2  # every per-sample figure is linear in the batch; 2 avoids size-1 special cases


@dataclass(frozen=True)
class ModelCost:
    parameters: int
    flops_per_sample: float  # forward + backward, as training computes them
    activation_bytes_per_sample: float  # saved for backward, nothing recomputed
    checkpointed_bytes_per_sample: float  # every block recomputed in backward (one block at a time)
    selective_bytes_per_sample: float  # every other block recomputed
    largest_bytes_per_sample: float  # the largest saved tensor: its gradient is live beside it
    blocks: int
    block_parameters: int  # inside the repeated blocks (what TP and pipeline stages split)
    block_activation_fraction: float  # of the saved bytes, the share saved inside blocks

    def activation_bytes(self, activation_checkpointing: str) -> float:
        return {
            "none": self.activation_bytes_per_sample,
            "full": self.checkpointed_bytes_per_sample,
            "selective": self.selective_bytes_per_sample,
        }[activation_checkpointing]


def meta_batch(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], batch: int) -> dict[str, torch.Tensor]:
    """Meta tensors of `batch` rows with each column's per-row shape and dtype."""
    return {
        name: torch.empty((batch, *shape), dtype=dtype, device="meta")
        for name, (shape, dtype) in shapes.items()
    }


def batch_shapes(batch: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A real batch's per-row shapes and dtypes, for `meta_batch`."""
    return {name: (tuple(t.shape[1:]), t.dtype) for name, t in batch.items()}


def _objective(objective: Objective | str, model: nn.Module) -> Objective:
    """A task name stands for that task's default objective (no data.columns, no model.loss)."""
    return objective if isinstance(objective, Objective) else Objective(objective, ForwardSignature.of(model))


class _FusedAttention(TorchFunctionMode):
    """On meta, scaled_dot_product_attention takes the math path, which saves the T x T
    attention matrix; real devices run fused kernels that keep only q, k, v, the output and
    a log-sum-exp. Trace the fused (memory-efficient) kernel, which has a meta version."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        names = ("attn_mask", "dropout_p", "is_causal")
        options = {**dict(zip(names, rest, strict=False)), **kwargs}
        fused = torch.ops.aten._scaled_dot_product_efficient_attention(
            query,
            key,
            value,
            options.get("attn_mask"),
            True,
            options.get("dropout_p", 0.0),
            options.get("is_causal", False),
            scale=options.get("scale"),
        )
        return fused[0]


class _SavedTensors:
    """Bytes of the distinct non-parameter storages autograd saves, and per block."""

    def __init__(self, model: nn.Module):
        self.parameters = {p.untyped_storage()._cdata for p in model.parameters()}
        self.sizes: dict[int, int] = {}
        self.block_bytes: list[int] = []
        self.block_inputs: list[int] = []

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.parameters:
            self.sizes[storage._cdata] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def watch(self, block: nn.Module) -> None:
        before: list[int] = []

        def pre(module: nn.Module, args: tuple) -> None:
            before.append(self.total)
            self.block_inputs.append(sum(a.nbytes for a in args if isinstance(a, torch.Tensor)))

        def post(module: nn.Module, args: tuple, output: Any) -> None:
            self.block_bytes.append(self.total - before.pop())

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [slot.module for slot in repeated_blocks(model)]


def trace_cost(
    model_cfg: dict[str, Any],
    objective: Objective | str,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    dtype: torch.dtype = torch.float32,
) -> ModelCost:
    """Trace one forward and backward of `TRACE_BATCH` samples of the model, on meta."""
    with torch.device("meta"):
        model = build_model(model_cfg).to(dtype)
    batch = meta_batch(shapes, TRACE_BATCH)
    saved = _SavedTensors(model)
    blocks = _blocks(model)
    for block in blocks:
        saved.watch(block)
    counter = FlopCounterMode(display=False)
    with counter, _FusedAttention(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        _objective(objective, model).step(model, batch, torch.device("meta")).loss.backward()
    full, selective = _checkpointed(saved)
    return ModelCost(
        parameters=sum(p.numel() for p in model.parameters()),
        flops_per_sample=counter.get_total_flops() / TRACE_BATCH,
        activation_bytes_per_sample=saved.total / TRACE_BATCH,
        checkpointed_bytes_per_sample=full / TRACE_BATCH,
        selective_bytes_per_sample=selective / TRACE_BATCH,
        largest_bytes_per_sample=max(saved.sizes.values(), default=0) / TRACE_BATCH,
        blocks=len(blocks),
        block_parameters=sum(p.numel() for block in blocks for p in block.parameters()),
        block_activation_fraction=sum(saved.block_bytes) / saved.total if saved.total else 0.0,
    )


def _checkpointed(saved: _SavedTensors) -> tuple[float, float]:
    """Saved bytes when every block (full) or every other block from the first (selective,
    as worker/parallel applies it) keeps only its input. Backward recomputes one block at a
    time, last first: the first one recomputed adds its activations on top unless a block
    after it (not recomputed) has already freed as much."""
    if not saved.block_bytes:
        return float(saved.total), float(saved.total)

    def keeping(recomputed: list[int]) -> float:
        dropped = sum(saved.block_bytes[i] - saved.block_inputs[i] for i in recomputed)
        first_recomputed = max(recomputed)
        freed_before = sum(saved.block_bytes[first_recomputed + 1 :])
        return saved.total - dropped + max(0, saved.block_bytes[first_recomputed] - freed_before)

    every = list(range(len(saved.block_bytes)))
    return keeping(every), keeping(every[::2])
