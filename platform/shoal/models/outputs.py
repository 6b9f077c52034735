"""What a model's forward may return, in one shape: `unpack_outputs(out)`.

A model may return logits (a tensor with a batch dimension), a loss (a 0-dim
tensor), or a mapping with `loss` and/or `logits` (a dict, or a Hugging Face
`ModelOutput`, which is a mapping); any other 0-dim entries of a mapping are
metrics the model measured itself, logged beside the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.models.registry import ModelError


@dataclass
class ModelOutputs:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def unpack_outputs(out: Any) -> ModelOutputs:
    if isinstance(out, torch.Tensor):
        return ModelOutputs(loss=out) if out.dim() == 0 else ModelOutputs(logits=out)
    if isinstance(out, Mapping):
        metrics = {
            str(key): value
            for key, value in out.items()
            if key not in ("loss", "logits") and isinstance(value, torch.Tensor) and value.dim() == 0
        }
        return ModelOutputs(out.get("loss"), out.get("logits"), metrics)
    raise ModelError(
        f"the model's forward returned {type(out).__name__}: return logits, a loss tensor, or a "
        "dict (or Hugging Face ModelOutput) with 'loss' and/or 'logits' (HF: return_dict=True)"
    )
