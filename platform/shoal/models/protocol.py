"""What a model class implements to run with tensor or pipeline parallelism.

shoal's generic code (worker/parallel, worker/precision.py, spec/checks.py,
plan/) names no module of any model: it asks the model for these four things
(torchtitan's ModelSpec with parallelize_fn / pipelining_fn plays this part
there). A model class without them trains with ddp, fsdp and hsdp only, and
`shoal validate` refuses tp or pp for it. The built-in GPT (models/gpt.py) is
the example to follow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class ParallelModel(Protocol):
    @classmethod
    def parallel_problems(cls, args: Mapping[str, Any], tp: int, stages: int) -> list[tuple[str, str]]:
        """Why the model built with `args` (the spec's model.args as written, without the
        constructor's defaults) cannot be split `tp` ways by tensor parallelism or into
        `stages` pipeline stages (1: no pipeline), as (spec path, message) pairs; none when
        it can. Runs in `shoal validate` and `shoal plan`, without building the model."""
        ...

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """Module paths to torch ParallelStyles (ColwiseParallel, RowwiseParallel...), for
        `parallelize_module` on the whole model; each dotted part may be a pattern
        (`blocks.*.attn.q`). The forward must run on the sharded modules (e.g. take the
        number of attention heads from the local shape)."""
        ...

    def pipeline_stage(self, stage: int, num_stages: int) -> nn.Module:
        """A copy of the model that computes only stage `stage` of `num_stages`, its parameters
        under their original names. Stage 0 takes the model's input; every later stage the
        output of the one before; the last returns what the loss takes."""
        ...

    def fp8_filter(self, module: nn.Module, fqn: str) -> bool:
        """Whether fp8 training converts this Linear layer (`fqn`: its path in the model)."""
        ...
