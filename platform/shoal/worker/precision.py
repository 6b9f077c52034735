"""Numeric precision: fp32, bf16 (FSDP mixed precision or autocast), fp16 (autocast +
GradScaler, skipped steps counted), fp8 (torchao float8 training on CUDA >= 8.9 only),
auto (bf16 where every rank's device runs it natively, else fp32: shoal/hardware.py)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shoal.errors import ShoalError
from shoal.hardware import device_hardware, resolve_auto
from shoal.models.protocol import ParallelModel

FP8_CAPABILITY = (8, 9)


class PrecisionError(ShoalError, RuntimeError):
    """A precision this device cannot run."""


def fp8_supported() -> bool:
    # get_device_capability() raises on a CPU build, so ask is_available() first.
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_CAPABILITY


def require_fp8() -> None:
    if not fp8_supported():
        have = (
            f"CUDA capability {torch.cuda.get_device_capability()}"
            if torch.cuda.is_available()
            else "no CUDA GPU"
        )
        raise PrecisionError(
            "train.precision fp8 needs a CUDA GPU of capability >= 8.9 (Ada, Hopper or newer); "
            f"this worker has {have}"
        )


def agreed_precision(asked: str, device: torch.device) -> str:
    """`auto` resolved on this rank's device; under a process group, the ranks' minimum (one
    tiny all-reduce), so one rank without native bf16 makes them all fp32: FSDP's all-gathers
    and the replicas' numerics need one precision. Any other name is returned as it is."""
    if asked != "auto":
        return asked
    resolved = resolve_auto(device_hardware(device))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        native = torch.tensor([int(resolved == "bf16")], device=device)
        dist.all_reduce(native, op=dist.ReduceOp.MIN)
        resolved = "bf16" if native.item() else "fp32"
    return resolved


class Precision:
    def __init__(self, name: str, device: torch.device, uses_fsdp: bool):
        """`name` is train.precision; `auto` is resolved here, with every rank (a collective
        under a process group: every rank builds its Precision at the same point)."""
        self.asked, self.device = name, device
        self.hardware = device_hardware(device).describe()
        self.name = name = agreed_precision(name, device)
        # fp8 is float8 matmuls in the converted Linears and bf16 everywhere else, as in
        # torchtitan: without it attention, norms and the rest would run in fp32
        self.fsdp_param_dtype = torch.bfloat16 if (name in ("bf16", "fp8") and uses_fsdp) else None
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(name)
        if self.fsdp_param_dtype is not None:
            self.autocast_dtype = None  # FSDP's MixedPrecisionPolicy casts the parameters
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        self.skipped_steps = 0
        if name == "fp8":
            require_fp8()

    def prepare(self, model: nn.Module) -> None:
        """Before parallelisation: swap Linear layers for float8 training ones (fp8 only); a
        ParallelModel chooses which (models/protocol.py), any other model converts them all."""
        if self.name != "fp8":
            return
        try:  # optional (shoal[fp8]), so imported only when fp8 is asked for
            from torchao.float8 import convert_to_float8_training
        except ImportError as exc:
            raise PrecisionError("train.precision fp8 needs torchao: pip install 'shoal[fp8]'") from exc
        keep = model.fp8_filter if isinstance(model, ParallelModel) else None
        convert_to_float8_training(model, module_filter_fn=keep)

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.scaler:
            for optimizer in optimizers:
                self.scaler.unscale_(optimizer)

    def step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Step every optimizer; False when fp16 found inf/nan gradients and skipped it."""
        if not self.scaler:
            for optimizer in optimizers:
                optimizer.step()
            return True
        before = self.scaler.get_scale()
        for optimizer in optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= before
        self.skipped_steps += 0 if stepped else 1
        return stepped
