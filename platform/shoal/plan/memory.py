"""Per-GPU memory of one training step under a parallel layout.

Parameter counts and activation bytes come from tracing the model on the meta
device (models/cost.py); this module divides them the way each degree does:

    weights     fp32 master weights (FSDP shards them; TP splits the blocks' share;
                pipeline stages hold their layers), plus autocast's cached
                low-precision copies when mixed precision runs through autocast
    gradients   same split as the weights (fp32)
    optimizer   AdamW: two fp32 moments; SGD: one momentum buffer; sharded like weights
    buckets     DDP's gradient buckets (one more copy of the gradients)
    activations saved for backward, per sample x micro-batch; TP splits the part of
                each block that is not its input or norms (Megatron-LM without
                sequence parallelism: 10 of 34 bytes per element stay replicated);
                pipeline stages hold their layers for the micro-batches in flight

The peak is at the start of backward (activations and their largest gradient
live) or at the optimizer step (gradients and the step's temporaries live),
whichever is larger.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.degrees import Degrees
from shoal.models.cost import ModelCost

REPLICATED_UNDER_TP = 10 / 34  # Korthikanti et al. 2022, activations per layer without SP
MIXED = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Layout(Degrees):
    """Degrees (keyword arguments) under the strategy name the spec gives them."""

    strategy: str

    def describe(self) -> str:
        return super().describe(none="1 GPU")


@dataclass(frozen=True)
class Training:
    """What the step does, beyond the model: precision, optimizer, checkpointing."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.9
    activation_checkpointing: str = "none"
    pipeline_microbatches: int | None = None  # default: the number of stages
    pipeline_schedule: str = "1f1b"


@dataclass(frozen=True)
class Estimate:
    weights: float
    gradients: float
    optimizer: float
    buckets: float
    activations: float
    transient: float  # beside the activations: the largest one's gradient
    step_temporaries: float  # beside the gradients: the optimizer's intermediate results

    @property
    def peak(self) -> float:
        static = self.weights + self.optimizer + self.buckets
        return static + max(self.activations + self.transient, self.gradients + self.step_temporaries)


def parameters_per_gpu(cost: ModelCost, layout: Layout) -> float:
    outside_blocks = cost.parameters - cost.block_parameters
    per_stage = outside_blocks + cost.block_parameters / layout.pp if layout.pp > 1 else cost.parameters
    if layout.tp > 1:
        per_stage -= cost.block_parameters / layout.pp * (1 - 1 / layout.tp)
    return per_stage / (layout.dp_shard if layout.uses_fsdp else 1)


def optimizer_bytes_per_parameter(training: Training) -> int:
    if training.optimizer == "adamw":
        return 8
    return 4 if training.momentum > 0 else 0


def activation_bytes(cost: ModelCost, layout: Layout, training: Training, micro: int) -> float:
    """Saved activations on one GPU for a micro-batch of `micro` samples per data-parallel slot."""
    per_sample = cost.activation_bytes(training.activation_checkpointing)
    if layout.tp > 1:
        block_share = cost.block_activation_fraction
        per_sample *= (1 - block_share) + block_share * (
            REPLICATED_UNDER_TP + (1 - REPLICATED_UNDER_TP) / layout.tp
        )
    if layout.pp == 1:
        return per_sample * micro
    chunks = training.pipeline_microbatches or layout.pp
    in_flight = chunks if training.pipeline_schedule == "gpipe" else min(layout.pp, chunks)
    return per_sample * (micro / chunks) * in_flight / layout.pp


def estimate(cost: ModelCost, layout: Layout, training: Training, micro: int) -> Estimate:
    params = parameters_per_gpu(cost, layout)
    cast_copies = 2 * params if training.precision in MIXED and not layout.uses_fsdp else 0.0
    return Estimate(
        weights=4 * params + cast_copies,
        gradients=4 * params,
        optimizer=optimizer_bytes_per_parameter(training) * params,
        buckets=4 * params if layout.uses_ddp else 0.0,
        activations=activation_bytes(cost, layout, training, micro),
        transient=cost.largest_bytes_per_sample * micro,
        # AdamW's foreach step builds the moments' square roots (one fp32 copy) before dividing.
        step_temporaries=4 * params if training.optimizer == "adamw" else 0.0,
    )
