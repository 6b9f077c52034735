"""The one-GPU check's arithmetic, none of which needs a GPU: the ladder of GPT sizes, the
workload each trains, the planner's memory estimate of it, which size fits a GPU, and the
throughput and MFU of timed steps.

The sizes are GPT-2/GPT-3 shapes over a GPT-2-sized vocabulary, 2,048-token windows and
micro-batches of 8 (16,384 tokens a step). A size fits when the planner's estimate of its
peak memory fits the planner's usable share of the GPU's memory (`shoal plan`'s own
headroom: CUDA's context and NCCL's buffers, then a share for fragmentation).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

SEQ_LEN = 2048
VOCAB = 50304  # GPT-2's 50,257 rounded up to a multiple of 64
MICRO_BATCH = 8
LR = 3e-4


@dataclass(frozen=True)
class Size:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int = SEQ_LEN
    vocab_size: int = VOCAB

    def args(self) -> dict[str, int]:
        return {
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
        }


LADDER = (  # smallest first; head dimension 64 or 128 (fused attention kernels)
    Size("125M", 12, 768, 12),
    Size("350M", 24, 1024, 16),
    Size("760M", 24, 1536, 16),
    Size("1.3B", 24, 2048, 16),
)
TINY = Size("tiny", 2, 64, 2, seq_len=64, vocab_size=512)  # the CPU smoke run of the tests
SIZES = {size.name: size for size in (*LADDER, TINY)}


def workload(size: Size, precision: str, micro: int, steps: int, compile_model: bool) -> Any:
    """The shoal Workload one GPU trains: FSDP strategy (on one GPU: dp_shard 1), AdamW,
    warm-up then cosine decay, gradient clipping, compile as asked."""
    from shoal.spec.schema import Workload  # deferred: pydantic may come from the carried wheels

    return Workload.model_validate(
        {
            "name": f"gpu-check-{size.name}",
            "model": {"family": "gpt", "args": size.args()},
            "data": {"builtin": "pytext", "batch_size": micro},
            "train": {
                "max_steps": steps,
                "precision": precision,
                "compile": compile_model,
                "optimizer": {"name": "adamw", "lr": LR, "weight_decay": 0.1, "betas": [0.9, 0.95]},
                "schedule": {"warmup_steps": min(10, steps // 5), "decay": "cosine"},
                "clip_grad_norm": 1.0,
            },
            "parallel": {"strategy": "fsdp"},
        }
    )


@dataclass(frozen=True)
class Planned:
    estimate_bytes: float  # the planner's peak for one GPU
    flops_per_step: float  # model FLOPs of one optimizer step, traced on meta
    parameters: int


def planned(work: Any, micro: int) -> Planned:
    """What the planner says of this workload on one GPU (the same trace `shoal plan` makes)."""
    # deferred: torch and the planner take seconds to import; the pure helpers below need neither
    from shoal.plan.memory import Layout, estimate
    from shoal.plan.planner import model_cost, training_of

    cost = model_cost(work, work.train.precision)
    peak = estimate(cost, Layout("fsdp", dp_shard=1), training_of(work), micro).peak
    return Planned(peak, cost.flops_per_sample * micro, cost.parameters)


def usable_bytes(memory_bytes: float) -> float:
    """The share of a GPU's memory the planner lets an estimate fill."""
    from shoal.plan.planner import RESERVED_BYTES, USABLE_SHARE  # deferred: as in planned()

    return USABLE_SHARE * (memory_bytes - RESERVED_BYTES)


def choose_size(usable: float, estimates: dict[str, float]) -> str | None:
    """The largest ladder size whose estimate fits `usable` bytes (None: not even the smallest)."""
    fitting = [size.name for size in LADDER if estimates[size.name] <= usable]
    return fitting[-1] if fitting else None


def ladder_estimates(precision: str, micro: int) -> dict[str, float]:
    return {
        size.name: planned(workload(size, precision, micro, 100, True), micro).estimate_bytes
        for size in LADDER
    }


def steady(values: list[float], warmup: int) -> list[float]:
    """The values after the warm-up steps (compile happens in the first)."""
    return values[warmup:]


def tokens_per_s(step_seconds: list[float], tokens_per_step: int) -> list[float]:
    return [tokens_per_step / s for s in step_seconds]


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second over the GPU's dense peak."""
    return flops_per_step / step_seconds / peak_flops


def loss_fell(losses: list[float], window: int = 5) -> tuple[float, float, bool]:
    """(mean of the first `window` losses, of the last `window`, whether it fell)."""
    first, last = statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])
    return first, last, last < first
