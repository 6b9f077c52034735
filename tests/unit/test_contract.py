"""The model contract (models/objective.py): what a forward may return, data.columns,
model.loss, task custom, and the window length of language-model data (no Ray)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.data.sources import plan_data, required_columns, window_length
from shoal.models.objective import ForwardSignature, Objective
from shoal.models.registry import ModelError, build_model, model_config

try:
    from transformers.utils import ModelOutput
except ImportError:  # the hf extra is optional: a Mapping dataclass has the same shape

    @dataclass
    class ModelOutput(Mapping):  # type: ignore[no-redef]
        def __getitem__(self, key: str) -> torch.Tensor:
            return self.__dict__[key]

        def __iter__(self) -> Iterator[str]:
            return iter(k for k, v in self.__dict__.items() if v is not None)

        def __len__(self) -> int:
            return len(list(iter(self)))


@dataclass
class ClassifierOutput(ModelOutput):  # an HF-style output: logits, no loss
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


CPU = torch.device("cpu")


class Linear(nn.Module):
    def __init__(self, returns: str = "logits"):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.returns = returns

    def forward(self, x: torch.Tensor) -> object:
        logits = self.fc(x)
        if self.returns == "dict":
            return {"logits": logits}
        if self.returns == "model_output":
            return ClassifierOutput(logits=logits)
        return logits


def classify_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(6, 4, generator=generator, dtype=torch.float64),
        "y": torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32),
        "id": torch.arange(6),
    }


@pytest.mark.parametrize("returns", ["logits", "dict", "model_output"])
def test_classify_gets_cross_entropy_whatever_holds_the_logits(returns: str) -> None:
    model, batch = Linear(returns), classify_batch()
    result = Objective.build("classify", model, {}, None).step(model, batch, CPU)
    logits = Linear().fc(batch["x"].float())
    assert torch.allclose(result.loss, F.cross_entropy(logits, batch["y"].long()))
    assert result.correct.item() == (logits.argmax(-1) == batch["y"]).sum().item()
    assert result.samples == 6 and result.metrics == {}


class Regressor(nn.Module):
    """A custom-task model on its own column names, returning a loss and a metric."""

    def __init__(self, returns: str = "dict"):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.returns = returns

    def forward(self, features: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> object:
        error = self.fc(features).squeeze(-1) * scale - target
        loss = (error**2).mean()
        if self.returns == "loss":
            return loss
        return {"loss": loss, "mae": error.abs().mean(), "ignored_vector": error}


def regression_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return {"f": torch.randn(5, 4, generator=generator), "t": torch.randn(5, generator=generator)}


@pytest.mark.parametrize("returns", ["loss", "dict"])
def test_custom_uses_the_models_loss_and_keeps_its_0_dim_metrics(returns: str) -> None:
    model, batch = Regressor(returns), regression_batch()
    objective = Objective.build("custom", model, {"f": "features", "t": "target"}, None)
    args, kwargs = objective.inputs(batch)
    assert args == () and set(kwargs) == {"features", "target"}
    result = objective.step(model, batch, CPU)
    error = model.fc(batch["f"]).squeeze(-1) - batch["t"]
    assert torch.allclose(result.loss, (error**2).mean())
    assert set(result.metrics) == ({"mae"} if returns == "dict" else set())


def test_custom_without_columns_passes_the_columns_the_forward_names() -> None:
    model = Regressor()
    batch = {
        "features": torch.randn(3, 4),
        "target": torch.randn(3),
        "id": torch.arange(3),
        "extra": torch.ones(3),
    }
    _, kwargs = Objective.build("custom", model, {}, None).inputs(batch)
    assert set(kwargs) == {"features", "target"}  # not id, not a column the forward does not take
    assert required_columns("custom", {}) == []


def test_custom_without_a_loss_is_a_clear_error() -> None:
    model = Linear()
    with pytest.raises(ModelError, match="task custom: the model returned logits; return a 'loss'"):
        Objective.build("custom", model, {"x": "x"}, None).step(model, classify_batch(), CPU)


def test_classify_labels_come_from_the_column_mapped_to_labels() -> None:
    model = Linear()
    batch = {"pixels": torch.randn(6, 4), "label": torch.tensor([2, 2, 1, 1, 0, 0])}
    objective = Objective.build("classify", model, {"pixels": "x", "label": "labels"}, None)
    _, kwargs = objective.inputs(batch)
    assert set(kwargs) == {"x"}  # the forward does not take labels: shoal's target only
    result = objective.step(model, batch, CPU)
    assert torch.allclose(result.loss, F.cross_entropy(model(batch["pixels"]), batch["label"]))
    assert required_columns("classify", {"pixels": "x", "label": "labels"}) == ["pixels", "label"]


class TinyLM(nn.Module):
    def __init__(self, only_loss: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 10)
        self.only_loss = only_loss
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> object:
        self.seen = {"input_ids": input_ids, "attention_mask": attention_mask}
        logits = self.embedding(input_ids)
        if self.only_loss:
            return {"loss": logits.mean() * 0 + 42.0}
        return {"logits": logits, "loss": torch.tensor(7.0)}


def test_lm_shifts_every_window_column_and_computes_next_token_cross_entropy() -> None:
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.uint8)
    batch = {"ids": tokens, "mask": torch.ones(2, 4, dtype=torch.int64)}
    model = TinyLM()
    objective = Objective.build("lm", model, {"ids": "input_ids", "mask": "attention_mask"}, None)
    result = objective.step(model, batch, CPU)
    assert model.seen["input_ids"].tolist() == [[1, 2, 3], [5, 6, 7]]
    assert model.seen["attention_mask"].shape == (2, 3)
    expected = F.cross_entropy(
        model.embedding(tokens[:, :-1].long()).flatten(0, 1), tokens[:, 1:].long().flatten()
    )
    assert torch.allclose(result.loss, expected)  # the model's own loss (7.0) is not used
    assert objective.predicted_tokens(batch) == 3


def test_an_lm_returning_only_a_loss_trains_on_that_loss() -> None:
    model = TinyLM(only_loss=True)
    objective = Objective.build("lm", model, {"tokens": "input_ids"}, None)
    assert objective.step(model, {"tokens": torch.tensor([[1, 2, 3]])}, CPU).loss.item() == 42.0


def test_the_default_lm_call_is_todays() -> None:
    model = build_model({"family": "gpt", "args": {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8}})
    tokens = torch.randint(0, 256, (2, 9))
    result = Objective.build("lm", model, {}, None).step(
        model, {"tokens": tokens, "id": torch.arange(2)}, CPU
    )
    logits = model(tokens[:, :-1])
    assert torch.allclose(result.loss, F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def test_model_loss_computes_the_loss_from_outputs_and_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_losses.py").write_text(
        "import torch\n"
        "def huber(outputs, batch):\n"
        "    prediction = outputs['loss'] * 0 + outputs['mae']\n"
        "    return {'loss': torch.nn.functional.huber_loss(prediction, batch['t'].mean()),\n"
        "            'mean_target': batch['t'].mean()}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model, batch = Regressor(), regression_batch()
    objective = Objective.build("custom", model, {"f": "features", "t": "target"}, "my_losses:huber")
    result = objective.step(model, batch, CPU)
    outputs = model(batch["f"], batch["t"])
    assert torch.allclose(result.loss, F.huber_loss(outputs["mae"], batch["t"].mean()))
    assert set(result.metrics) == {"mae", "mean_target"}
    sys.modules.pop("my_losses", None)


def test_a_loss_that_is_not_0_dim_is_refused() -> None:
    class PerSample(nn.Module):
        def forward(self, x: torch.Tensor) -> dict:
            return {"loss": x.sum(-1)}

    model = PerSample()
    with pytest.raises(ModelError, match=r"must be a 0-dim tensor \(got \(6,\)\)"):
        Objective.build("custom", model, {"x": "x"}, None).step(model, classify_batch(), CPU)


def test_forward_signature_of_a_class_and_an_instance_agree() -> None:
    assert ForwardSignature.of(Regressor) == ForwardSignature.of(Regressor())
    signature = ForwardSignature.of(Regressor)
    assert signature.required == ("features", "target") and signature.takes("scale")
    assert signature.describe() == "forward(features (required), target (required), scale)"


# -- the window length of language-model data ---------------------------------------------


def test_data_seq_len_wins_and_model_args_seq_len_is_the_fallback() -> None:
    assert window_length(64, {"seq_len": 32}) == 64
    assert window_length(None, {"seq_len": 32}) == 32
    assert window_length(None, {}) is None


def test_a_model_taking_seq_len_gets_the_datas_when_its_args_do_not_set_it() -> None:
    gpt = {"family": "gpt", "args": {"n_layers": 1}}
    assert model_config(gpt, 48)["args"] == {"n_layers": 1, "seq_len": 48}
    assert model_config({**gpt, "args": {"seq_len": 8}}, 48)["args"] == {"seq_len": 8}
    mlp = {"family": "mlp", "args": {}}
    assert model_config(mlp, 48) == mlp  # MLP takes no seq_len


def test_pytext_is_windowed_by_data_seq_len() -> None:
    model = {"family": "gpt", "args": {}}
    plan = plan_data({"builtin": "pytext", "seq_len": 24}, model, "lm", prepare_builtin=True)
    first = pq.read_table(plan.train[0])
    assert first.schema.field("tokens").type.list_size == 25
    old = plan_data({"builtin": "pytext"}, {"family": "gpt", "args": {"seq_len": 24}}, "lm", True)
    assert old.train == plan.train  # model.args.seq_len: the same corpus as before


def test_loss_per_sample_of_a_uniform_model_is_log_vocab() -> None:
    """Sanity of the lm objective: zero logits give log(vocab) nats per token."""

    class Uniform(nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*tokens.shape, 256, requires_grad=True)

    model = Uniform()
    result = Objective.build("lm", model, {}, None).step(
        model, {"tokens": torch.randint(0, 256, (3, 9))}, CPU
    )
    assert result.loss.item() == pytest.approx(math.log(256))
