"""The final model as an MLflow model: any batch size and length, registered, loaded back."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from shoal.models.gpt import GPT
from shoal.spec.schema import RegisterSpec, TokenizerSpec, Workload
from shoal.tracking.mlflow_run import TrackingError
from shoal.tracking.model_log import (
    TOKENIZER_DIR,
    URI_TAG,
    hf_tokenizer,
    log_model,
    model_example,
    recorded_tokenizer,
    register_run_model,
    token_example,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """One MLflow store for the module (a new sqlite store takes seconds to set up)."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    return uri, MlflowClient(tracking_uri=uri).create_experiment("models", artifact_location=str(root / "a"))


@pytest.fixture
def tracked(store: tuple[str, str]) -> tuple[str, str]:
    """A fresh run in the module's store: (tracking URI, run id)."""
    uri, experiment = store
    return uri, MlflowClient(tracking_uri=uri).create_run(experiment).info.run_id


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, seq_len=16, d_model=16, n_layers=1, n_heads=2).eval()


def test_pytorch_flavour_takes_any_batch_and_length_and_loads_by_alias(tracked: tuple[str, str]) -> None:
    uri, run_id = tracked
    model = tiny_gpt()
    logged = log_model(
        uri,
        run_id,
        model,
        token_example(model),
        sequence=True,
        register=RegisterSpec(name="tiny", alias="best"),
    )
    assert logged.uri == "models:/tiny@best" and logged.version == "1"
    assert logged.serialization == "pt2" and logged.flavor == "pytorch"
    assert MlflowClient(tracking_uri=uri).get_run(run_id).data.tags[URI_TAG] == "models:/tiny@best"
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model("models:/tiny@best")
    pyfunc = mlflow.pyfunc.load_model("models:/tiny@best")
    for batch, length in ((1, 5), (3, 9), (3, 5), (1, 9)):
        tokens = torch.randint(0, 64, (batch, length))
        with torch.no_grad():
            expected = model(tokens)
        assert torch.allclose(loaded(tokens), expected, atol=1e-6), (batch, length)
        predicted = pyfunc.predict(tokens.numpy())
        assert np.allclose(predicted, expected.numpy(), atol=1e-6), (batch, length)


class DictNet(torch.nn.Module):
    """A classifier whose forward returns a mapping: the logged model returns its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.body(x), "norm": x.norm()}


def test_a_model_returning_a_dict_is_logged_returning_logits(tracked: tuple[str, str]) -> None:
    uri, run_id = tracked
    model = DictNet().eval()
    logged = log_model(uri, run_id, model, torch.randn(2, 6))
    assert logged.uri.startswith("models:/") and logged.version is None
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model(logged.uri)
    x = torch.randn(5, 6)
    assert torch.allclose(loaded(x), model(x)["logits"], atol=1e-6)


def tiny_hf() -> tuple:
    """A GPT2 from a tiny config and a BPE tokenizer trained here: nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>", "<unk>"])
    bpe.train_from_iterator(["hello world", "the quick brown fox", "shoal trains models"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="<unk>")
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval(), tokenizer


def test_transformers_flavour_with_its_tokenizer_registers_and_generates(tracked: tuple[str, str]) -> None:
    uri, run_id = tracked
    model, tokenizer = tiny_hf()
    logged = log_model(
        uri, run_id, model, tokenizer=tokenizer, register=RegisterSpec(name="tinyhf", alias="prod")
    )
    assert (logged.flavor, logged.uri, logged.version) == ("transformers", "models:/tinyhf@prod", "1")
    mlflow.set_tracking_uri(uri)
    parts = mlflow.transformers.load_model("models:/tinyhf@prod", return_type="components")
    ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(parts["model"](ids).logits, model(ids).logits, atol=1e-6)
    assert parts["tokenizer"]("hello world")["input_ids"] == ids[0].tolist()
    generated = mlflow.pyfunc.load_model("models:/tinyhf@prod").predict(["hello"])
    assert isinstance(generated[0], str) and generated[0].startswith("hello")


def test_an_hf_model_without_a_tokenizer_is_logged_returning_its_logits(tracked: tuple[str, str]) -> None:
    uri, run_id = tracked
    model, _ = tiny_hf()
    logged = log_model(uri, run_id, model, token_example(model), sequence=True)
    assert logged.flavor == "pytorch"
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model(logged.uri)
    for shape in ((1, 5), (3, 9)):
        ids = torch.randint(0, model.config.vocab_size, shape)
        with torch.no_grad():
            assert torch.allclose(loaded(ids), model(ids).logits, atol=1e-5), (shape, logged.serialization)


def test_a_runs_logged_model_is_registered_afterwards(tracked: tuple[str, str]) -> None:
    """What a sweep does with its best trial: the trial logged its model unregistered."""
    uri, run_id = tracked
    model = tiny_gpt()
    assert log_model(uri, run_id, model, token_example(model), sequence=True).version is None
    assert (
        register_run_model(uri, run_id, RegisterSpec(name="best", alias="champion"))
        == "models:/best@champion"
    )
    mlflow.set_tracking_uri(uri)
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.allclose(
            mlflow.pytorch.load_model("models:/best@champion")(tokens), model(tokens), atol=1e-6
        )
    other = MlflowClient(tracking_uri=uri).create_run(
        MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id
    )
    with pytest.raises(TrackingError, match="logged no model"):
        register_run_model(uri, other.info.run_id, RegisterSpec(name="best"))


def test_the_runs_tokenizer_is_found_in_its_folder_or_its_mlflow_artifact(
    tracked: tuple[str, str], tmp_path: Path
) -> None:
    uri, run_id = tracked
    _, tokenizer = tiny_hf()
    folder = tmp_path / "run" / TOKENIZER_DIR
    tokenizer.save_pretrained(folder)
    hf = {"hf": {"config": {"model_type": "gpt2", "vocab_size": len(tokenizer)}}}
    workload = Workload.model_validate(
        {
            "name": "w",
            "model": hf,
            "data": {"train": {"path": "t.jsonl"}},
            "tokenizer": {"type": "train_bpe", "vocab_size": 120},
            "train": {"max_steps": 1},
        }
    )
    ids = tokenizer("hello world")["input_ids"]
    assert hf_tokenizer(workload, folder)("hello world")["input_ids"] == ids
    assert recorded_tokenizer(workload, uri, run_id) is None  # nothing logged yet
    MlflowClient(tracking_uri=uri).log_artifacts(run_id, str(folder), TOKENIZER_DIR)
    assert recorded_tokenizer(workload, uri, run_id)("hello world")["input_ids"] == ids
    byte = workload.model_copy(update={"tokenizer": TokenizerSpec(type="byte")})
    assert hf_tokenizer(byte, tmp_path / "nothing") is None


def test_a_classifiers_example_comes_from_its_mapped_data_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [[float(i + j) for j in range(6)] for i in range(4)]
    pq.write_table(pa.table({"pixels": rows, "label": [0, 1, 0, 1]}), tmp_path / "t.parquet")
    spec = {"name": "w", "model": {"family": "mlp"}, "train": {"max_steps": 1}}
    mapped = Workload.model_validate(
        {**spec, "data": {"train": {"path": str(tmp_path)}, "columns": {"pixels": "x", "label": "y"}}}
    )
    example, sequence = model_example(DictNet(), mapped, "classify", [str(tmp_path / "t.parquet")])
    assert not sequence and torch.equal(example, torch.tensor(rows[:2]))
    unmapped = Workload.model_validate({**spec, "data": {"train": {"path": str(tmp_path)}}})
    assert model_example(DictNet(), unmapped, "classify", [str(tmp_path / "t.parquet")]) == (None, False)


class Branchy(torch.nn.Module):
    """Data-dependent Python control flow: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:
            return self.body(x)
        return -self.body(x)


def test_a_model_torch_export_refuses_is_pickled(tracked: tuple[str, str]) -> None:
    uri, run_id = tracked
    model = Branchy().eval()
    logged = log_model(uri, run_id, model, torch.ones(2, 4))
    assert logged.serialization == "pickle"
    assert MlflowClient(tracking_uri=uri).get_run(run_id).data.tags["shoal.model_format"] == "pickle"
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model(logged.uri)
    for x in (torch.ones(3, 4), -torch.ones(1, 4)):
        assert torch.allclose(loaded(x), model(x))
