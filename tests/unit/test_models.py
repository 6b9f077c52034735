"""Built-in model families and user models by `module:Class`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal.models import ModelError, ParallelModel, build_model, count_parameters, model_class, model_task
from shoal.models.gpt import GPT


def test_cnn_classifies_digit_shaped_input() -> None:
    model = build_model({"family": "cnn", "args": {"channels": 8}})
    assert model(torch.rand(5, 64)).shape == (5, 10)
    assert model_task(type(model), None) == "classify"


def test_mlp_classifies_flat_input() -> None:
    model = build_model({"family": "mlp", "args": {"in_features": 64, "hidden": 16}})
    assert model(torch.rand(3, 64)).shape == (3, 10)


def test_gpt_shapes_and_causality() -> None:
    torch.manual_seed(0)
    model = build_model(
        {"family": "gpt", "args": {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16}}
    )
    model.eval()
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256  # the future must not change the past
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert model_task(type(model), None) == "lm"


def test_gpt_ties_embedding_and_head() -> None:
    model = build_model({"family": "gpt", "args": {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8}})
    assert model.lm_head.weight is model.token_embedding.weight
    assert count_parameters(model) < sum(p.numel() for p in model.state_dict().values())


def test_gpt_rejects_bad_heads() -> None:
    with pytest.raises(ModelError, match="divisible by n_heads"):
        build_model({"family": "gpt", "args": {"d_model": 30, "n_heads": 4}})


def test_gpt_learns_a_repeating_sequence() -> None:
    torch.manual_seed(0)
    model = build_model(
        {"family": "gpt", "args": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16}}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(17).repeat(4, 1) % 5
    for _ in range(100):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


def test_user_model_by_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "class Linear(torch.nn.Module):\n"
        "    task = 'classify'\n"
        "    def __init__(self, width=64):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(width, 10)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "NotAModule = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model({"target": "my_models:Linear", "args": {"width": 64}})
    assert model(torch.rand(2, 64)).shape == (2, 10)
    with pytest.raises(ModelError, match="has no attribute 'Missing'"):
        model_class(None, "my_models:Missing")
    with pytest.raises(ModelError, match="not a torch.nn.Module subclass"):
        model_class(None, "my_models:NotAModule")


def test_declared_task_overrides_class_attribute() -> None:
    assert model_task(model_class("cnn", None), "lm") == "lm"
    with pytest.raises(ModelError, match="task must be one of"):
        model_task(model_class("cnn", None), "regress")


def test_gpt_implements_the_parallel_protocol_and_the_others_do_not() -> None:
    assert issubclass(model_class("gpt", None), ParallelModel)
    assert not issubclass(model_class("cnn", None), ParallelModel)
    assert not issubclass(model_class("mlp", None), ParallelModel)


def test_gpt_pipeline_stages_chain_to_the_whole_model() -> None:
    torch.manual_seed(0)
    model = GPT(n_layers=3, d_model=32, n_heads=2, seq_len=16, tie_embeddings=False).eval()
    stages = [model.pipeline_stage(s, 2) for s in range(2)]
    assert list(stages[0].blocks) == ["0", "1"] and list(stages[1].blocks) == ["2"]
    names = [set(stage.state_dict()) for stage in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(model.state_dict())
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(stages[1](stages[0](tokens)), model(tokens))


def test_gpt_names_its_own_parallel_problems() -> None:
    assert GPT.parallel_problems({}, tp=2, stages=1) == []
    assert GPT.parallel_problems({"n_heads": 4}, tp=3, stages=1) == [
        ("parallel.tp", "model.args.n_heads (4) is not divisible by tp (3)")
    ]
    paths = [path for path, _ in GPT.parallel_problems({"n_layers": 1}, tp=1, stages=2)]
    assert paths == ["parallel.pp", "model.args"]  # too few layers; tied embeddings
    assert GPT.parallel_problems({"tie_embeddings": False}, tp=1, stages=4) == []
    model = GPT(n_layers=1, d_model=32, n_heads=2, seq_len=8)
    assert set(model.tensor_parallel_plan()) >= {"blocks.*.attn.q", "blocks.*.mlp.down"}
    assert not model.fp8_filter(model.lm_head, "lm_head") and model.fp8_filter(model.blocks["0"].mlp.up, "x")
