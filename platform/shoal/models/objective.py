"""What one micro-batch trains: the forward's inputs, the loss, and the model's own metrics.

One `Objective` per run, used by the worker's Engine (training and evaluation),
the cost trace on the meta device (models/cost.py) and the pre-launch trace of
`shoal validate` (spec/checks.py), so all three call the model the same way.

- Batches are dicts of columns. `data.columns` maps data columns to forward
  arguments, which the forward receives as keyword arguments. Without it:
  `classify` calls `model(x)` and takes its labels from `y`; `lm` calls
  `model(tokens[:, :-1])` against `tokens[:, 1:]`; `custom` passes every column
  the forward names (every column but `id` to a forward taking `**kwargs`).
- What the forward returns goes through `unpack_outputs` (logits, a 0-dim loss,
  or a dict / ModelOutput with `loss`, `logits` and 0-dim metrics).
- The loss: `model.loss` (any task) computes it from (outputs, batch); else
  `classify` and `lm` compute cross entropy from the logits (next-token for
  `lm`) and use the model's own loss only when it returns no logits; `custom`
  uses the loss the model returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.data.sources import required_columns
from shoal.models.outputs import ModelOutputs, unpack_outputs
from shoal.models.registry import ModelError, import_loss

LABEL_ARGUMENTS = ("labels", "label", "y")  # classify: a column mapped to one of these is the label
TOKEN_ARGUMENTS = ("input_ids", "tokens")  # lm: a column mapped to one of these is the token window
DEFAULT_COLUMNS = {"classify": {"x": "x"}, "lm": {"tokens": "tokens"}}  # passed positionally
LABEL_COLUMN = "y"  # classify without data.columns
BOOKKEEPING_COLUMNS = ("id",)  # never passed to a forward unless data.columns says so


@dataclass(frozen=True)
class ForwardSignature:
    """The arguments a model's forward takes (without `self`)."""

    names: tuple[str, ...]
    required: tuple[str, ...]
    var_keyword: bool = False
    var_positional: bool = False

    @classmethod
    def of(cls, model: nn.Module | type[nn.Module]) -> ForwardSignature:
        forward = model.forward
        parameters = list(inspect.signature(forward).parameters.values())
        if inspect.isclass(model):
            parameters = parameters[1:]  # unbound: drop self
        names, required = [], []
        var_keyword = var_positional = False
        for p in parameters:
            if p.kind is p.VAR_KEYWORD:
                var_keyword = True
            elif p.kind is p.VAR_POSITIONAL:
                var_positional = True
            else:
                names.append(p.name)
                if p.default is p.empty:
                    required.append(p.name)
        return cls(tuple(names), tuple(required), var_keyword, var_positional)

    def takes(self, name: str) -> bool:
        return self.var_keyword or name in self.names

    def describe(self) -> str:
        parts = [n if n not in self.required else f"{n} (required)" for n in self.names]
        parts += ["*args"] if self.var_positional else []
        parts += ["**kwargs"] if self.var_keyword else []
        return f"forward({', '.join(parts)})"


@dataclass
class StepResult:
    """One micro-batch's loss (0-dim), correct predictions (classify) and the model's metrics."""

    loss: torch.Tensor
    samples: int
    correct: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def as_model_input(tensor: torch.Tensor) -> torch.Tensor:
    """Float columns as float32, integer ones as int64 (what layers, embeddings and cross
    entropy take); bool and half-precision columns as they are."""
    if tensor.dtype == torch.float64:
        return tensor.float()
    if not tensor.dtype.is_floating_point and tensor.dtype not in (torch.bool, torch.int64):
        return tensor.long()
    return tensor


@dataclass(frozen=True)
class Objective:
    task: str  # classify | lm | custom
    signature: ForwardSignature
    columns: dict[str, str] = field(default_factory=dict)  # data.columns (empty: the task's default)
    loss_fn: Callable[..., Any] | None = None  # model.loss

    @classmethod
    def build(
        cls, task: str, model: nn.Module | type[nn.Module], columns: Mapping[str, str], loss: str | None
    ) -> Objective:
        return cls(task, ForwardSignature.of(model), dict(columns), import_loss(loss) if loss else None)

    # -- which columns feed what ------------------------------------------------------
    def feeds(self, available: list[str]) -> dict[str, str]:
        """Data column -> forward argument, for a batch with these columns."""
        if self.columns:
            return {c: a for c, a in self.columns.items() if not self._label_only(a)}
        if self.task in DEFAULT_COLUMNS:
            return dict(DEFAULT_COLUMNS[self.task])
        return {c: c for c in available if c not in BOOKKEEPING_COLUMNS and self.signature.takes(c)}

    def _label_only(self, argument: str) -> bool:
        """A classify label the forward does not take: shoal's target, not an input."""
        return self.task == "classify" and argument in LABEL_ARGUMENTS and not self.signature.takes(argument)

    @property
    def positional(self) -> bool:
        """classify and lm without data.columns call the forward with one positional tensor."""
        return not self.columns and self.task in DEFAULT_COLUMNS

    def label_column(self) -> str | None:
        if self.task != "classify":
            return None
        if not self.columns:
            return LABEL_COLUMN
        return next((c for c, a in self.columns.items() if a in LABEL_ARGUMENTS), None)

    def token_column(self) -> str | None:
        """lm: the column holding windows of seq_len + 1 tokens."""
        if self.task != "lm":
            return None
        if not self.columns:
            return "tokens"
        named = [c for c, a in self.columns.items() if a in TOKEN_ARGUMENTS]
        return (named or list(self.columns))[0]

    def required_columns(self) -> list[str]:
        """Columns the data must have (custom without data.columns: whatever the forward needs)."""
        return required_columns(self.task, self.columns)

    def predicted_tokens(self, batch: Mapping[str, torch.Tensor]) -> int:
        """lm: next-token predictions per sample (a window of T + 1 tokens trains T)."""
        column = self.token_column()
        return batch[column].shape[1] - 1 if column is not None else 0

    # -- one micro-batch ------------------------------------------------------------------
    def inputs(self, batch: Mapping[str, torch.Tensor]) -> tuple[tuple, dict[str, torch.Tensor]]:
        """The forward's positional and keyword arguments; lm windows lose their last token
        (as does every column of the window's shape: masks, positions)."""
        feeds = self.feeds(list(batch))
        window = self.token_column()
        values = {}
        for column, argument in feeds.items():
            tensor = batch[column]
            if window is not None and tensor.dim() >= 2 and tensor.shape[:2] == batch[window].shape[:2]:
                tensor = tensor[:, :-1]
            values[argument] = tensor.float() if self.positional and self.task == "classify" else tensor
        if self.positional:
            return tuple(values.values()), {}
        return (), values

    def step(self, model: nn.Module, batch: Mapping[str, torch.Tensor], device: torch.device) -> StepResult:
        """Forward one micro-batch (moved to `device`) and compute its loss."""
        batch = {k: as_model_input(v.to(device, non_blocking=True)) for k, v in batch.items()}
        args, kwargs = self.inputs(batch)
        raw = model(*args, **kwargs)
        outputs = unpack_outputs(raw)
        samples = len(next(iter(batch.values())))
        result = StepResult(torch.zeros((), device=device), samples, metrics=dict(outputs.metrics))
        if self.task == "classify":
            result.correct = self._correct(outputs, batch)
        if self.loss_fn is not None:
            user = unpack_outputs(self.loss_fn(raw, batch))
            result.loss = self._checked_loss(user.loss, "model.loss")
            result.metrics.update(user.metrics)
        else:
            result.loss = self._task_loss(outputs, batch)
        return result

    def _correct(self, outputs: ModelOutputs, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        label = self.label_column()
        if outputs.logits is None or label is None:
            return torch.zeros(())
        return (outputs.logits.argmax(dim=-1) == batch[label]).sum()

    def _task_loss(self, outputs: ModelOutputs, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.task == "classify" and outputs.logits is not None:
            label = self.label_column()
            if label is None:
                raise ModelError(
                    "task classify needs a label: map a column to 'labels' or 'y' in data.columns"
                )
            return F.cross_entropy(outputs.logits.float(), batch[label])
        if self.task == "lm" and outputs.logits is not None:
            tokens = batch[self.token_column()]  # type: ignore[index]
            return F.cross_entropy(outputs.logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if outputs.loss is None:
            returned = "logits" if outputs.logits is not None else "neither 'loss' nor 'logits'"
            raise ModelError(
                f"task {self.task}: the model returned {returned}; return a 'loss' "
                "(or set model.loss: module:function(outputs, batch))"
            )
        return self._checked_loss(outputs.loss, "the model's loss")

    @staticmethod
    def _checked_loss(loss: Any, what: str) -> torch.Tensor:
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ModelError(f"{what} must be a 0-dim tensor (got {shape})")
        return loss.float()
