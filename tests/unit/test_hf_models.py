"""Hugging Face models (model.hf): built from a config or a local folder, refused when they
would reach the hub, parallel per their own blocks, tensor-parallel for Llama. No Ray.

Every test here runs with the network closed to anything but loopback."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

import shoal.models
from shoal import cli
from shoal.models import ModelError, ParallelModel, build_model
from shoal.models.blocks import repeated_blocks
from shoal.models.hf import LlamaForCausalLM, as_spec, check_hf
from shoal.models.outputs import unpack_outputs
from shoal.spec import load
from shoal.worker.parallel.parallelize import apply_activation_checkpointing
from tests.conftest import write_workload
from tests.unit.parallel_harness import llama_spec, run
from tests.unit.test_parallel_equivalence import FP32_LOSS, FP32_WEIGHTS, max_weight_difference

LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection beyond this machine fails the test: proof that nothing reaches a hub."""
    connect = socket.socket.connect

    def guarded(sock: socket.socket, address: object) -> None:
        host = address[0] if isinstance(address, tuple) else None
        if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network connection to {address} during a test")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def hf(cls: str = "LlamaForCausalLM", **source: object) -> dict:
    return {"hf": {"class": cls, **(source or {"config": LLAMA})}}


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("cls", "config"), [("AutoModelForCausalLM", GPT2), ("LlamaForCausalLM", LLAMA)])
def test_causal_lms_build_from_a_config_with_logits_over_its_vocabulary(cls: str, config: dict) -> None:
    model = build_model(hf(cls, config=config))
    logits = unpack_outputs(model(tokens())).logits
    assert logits.shape == (2, 8, 256)
    assert check_hf(as_spec({"class": cls, "config": config}), None).task == "lm"
    assert len(repeated_blocks(model)) == 2  # GPT2Block / LlamaDecoderLayer, from _no_split_modules


def test_a_save_pretrained_folder_loads_with_the_same_logits(tmp_path: Path) -> None:
    built = build_model(hf()).eval()
    built.save_pretrained(tmp_path / "llama")
    loaded = build_model(hf(path=str(tmp_path / "llama"))).eval()
    assert type(loaded) is LlamaForCausalLM
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    with torch.no_grad():
        assert torch.equal(built(tokens()).logits, loaded(tokens()).logits)


def test_the_task_follows_the_class_unless_the_spec_says_otherwise() -> None:
    settings = {**LLAMA, "num_labels": 3}
    with pytest.raises(ModelError, match="needs pad_token_id"):
        check_hf(as_spec({"class": "AutoModelForSequenceClassification", "config": settings}), None)
    classifier = as_spec(
        {"class": "AutoModelForSequenceClassification", "config": {**settings, "pad_token_id": 0}}
    )
    assert check_hf(classifier, None).task == "classify"
    assert check_hf(classifier, "custom").task == "custom"
    model = build_model({"hf": classifier.model_dump()})
    assert unpack_outputs(model(tokens())).logits.shape == (2, 3)


def test_activation_checkpointing_keeps_parameter_names_and_gradients() -> None:
    torch.manual_seed(0)
    plain = build_model(hf())
    wrapped = build_model(hf())
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped, "full")
    assert type(wrapped.model.layers[0]).__name__ == "CheckpointWrapper"
    assert len(repeated_blocks(wrapped)) == 2  # still found through the wrapper
    assert set(wrapped.state_dict()) == set(plain.state_dict())
    for model in (plain, wrapped):
        unpack_outputs(model(tokens())).logits.square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_only_the_llama_family_implements_the_parallel_protocol() -> None:
    assert isinstance(build_model(hf()), ParallelModel)
    assert not isinstance(build_model(hf("AutoModelForCausalLM", config=GPT2)), ParallelModel)


def validate(tmp_path: Path, capsys: pytest.CaptureFixture, model: dict, **extra: object) -> list[str]:
    """`shoal validate` in this process: its exit code must be 2; returns stderr's lines."""
    data = {
        "name": "hf",
        "model": model,
        "data": {"builtin": "pytext", "batch_size": 4, "seq_len": 32},
        "train": {"max_steps": 2},
        **extra,
    }
    path = write_workload(tmp_path, data)
    capsys.readouterr()  # only what validate prints
    assert cli.main(["validate", str(path)]) == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def remote_code_folder(tmp_path: Path) -> str:
    folder = tmp_path / "remote"
    build_model(hf()).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def config_only_folder(tmp_path: Path) -> str:
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return str(folder)


REFUSALS = {
    "hub name": (lambda tmp: hf(path="meta-llama/Llama-3.2-1B"), "model.hf.path", "not an existing local"),
    "missing folder": (lambda tmp: hf(path=str(tmp / "nowhere")), "model.hf.path", "not an existing local"),
    "unknown class": (
        lambda tmp: hf("LlamaForMagic"),
        "model.hf.class",
        "has no model class 'LlamaForMagic'",
    ),
    "remote code in config": (
        lambda tmp: hf("AutoModelForCausalLM", config={**LLAMA, "auto_map": {"AutoConfig": "x.Y"}}),
        "model.hf.config",
        "remote code (auto_map)",
    ),
    "trust_remote_code": (
        lambda tmp: hf(config={**LLAMA, "trust_remote_code": True}),
        "model.hf.config",
        "remote code (trust_remote_code)",
    ),
    "remote code in folder": (lambda tmp: hf(path=remote_code_folder(tmp)), "model.hf.path", "remote code"),
    "folder without weights": (
        lambda tmp: hf(path=config_only_folder(tmp)),
        "model.hf.path",
        "holds no weights",
    ),
    "class and config disagree": (lambda tmp: hf("GPT2LMHeadModel"), "model.hf.class", "not 'llama'"),
    "misspelt setting": (
        lambda tmp: hf(config={**LLAMA, "hiden_size": 8}),
        "model.hf.config.hiden_size",
        "no setting 'hiden_size'",
    ),
    "unbuildable config": (
        lambda tmp: hf(config={**LLAMA, "hidden_size": 30}),
        "model.hf.config",
        "not a multiple",
    ),
    "vocabulary below bytes": (
        lambda tmp: hf(config={**LLAMA, "vocab_size": 100}),
        "model.hf.config",
        "smaller than the 256 bytes",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_validate_refuses_with_one_line(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_model, where, reason = REFUSALS[name]
    monkeypatch.chdir(tmp_path)
    lines = validate(tmp_path, capsys, make_model(tmp_path))
    assert len(lines) == 1, lines
    assert where in lines[0] and reason in lines[0], lines[0]


def test_validate_refuses_pipelines_for_hf_and_tp_for_models_without_the_protocol(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    parallel = {"parallel": {"strategy": "pp"}, "scaling": {"workers": 2}}
    [line] = validate(tmp_path, capsys, hf(), **parallel)
    assert "parallel.pp" in line and "pipeline stages" in line
    parallel = {"parallel": {"strategy": "tp"}, "scaling": {"workers": 2}}
    [line] = validate(tmp_path, capsys, hf("AutoModelForCausalLM", config=GPT2), **parallel)
    assert "'GPT2LMHeadModel' supports ddp, fsdp and hsdp only" in line
    parallel = {"parallel": {"strategy": "tp"}, "scaling": {"workers": 4}}
    [line] = validate(tmp_path, capsys, hf(), **parallel)
    assert "num_key_value_heads (2) is not divisible by tp (4)" in line


def test_validate_accepts_a_tiny_llama_with_fsdp(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = {
        "name": "hf",
        "model": hf(),
        "data": {"builtin": "pytext", "batch_size": 4, "seq_len": 32},
        "train": {"max_steps": 2},
        "parallel": {"strategy": "fsdp"},
        "scaling": {"workers": 2},
    }
    assert cli.main(["validate", str(write_workload(tmp_path, data))]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out


# -- the strategies on gloo ranks, against one process -----------------------------------------
@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(llama_spec({}), 1, tmp_path_factory.mktemp("llama-reference"))[0]


@pytest.mark.parametrize(
    ("parallel", "world", "activation_checkpointing"),
    [
        ({"strategy": "fsdp"}, 2, "full"),
        ({"strategy": "tp"}, 2, "selective"),
        ({"dp_shard": 2, "tp": 2}, 4, "none"),
    ],
    ids=["fsdp+full-ac", "tp+selective-ac", "fsdp-x-tp"],
)
def test_llama_on_several_ranks_matches_one_process(
    parallel: dict, world: int, activation_checkpointing: str, llama_reference: dict, tmp_path: Path
) -> None:
    outputs = run(llama_spec(parallel, activation_checkpointing), world, tmp_path)
    for output in outputs:
        assert output["losses"] == pytest.approx(llama_reference["losses"], abs=FP32_LOSS)
        # FSDP holds half of every block on each rank; TP half of every q/k/v/o/gate/up/down.
        assert output["local_params"] < 0.75 * output["parameters"]
    assert max_weight_difference(outputs, llama_reference) < FP32_WEIGHTS


def test_a_relative_folder_is_resolved_for_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_model(hf()).save_pretrained(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    data = {
        "name": "hf",
        "model": hf(path="llama"),
        "data": {"builtin": "pytext", "batch_size": 4, "seq_len": 32},
        "train": {"max_steps": 2},
    }
    loaded = load(write_workload(tmp_path, data))
    assert loaded.data.task == "lm"
    assert loaded.workload.model.hf.path == str(tmp_path / "llama")


def test_without_transformers_validate_says_which_extra_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "shoal.models.hf")
    monkeypatch.delattr(shoal.models, "hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    [line] = validate(tmp_path, capsys, hf())
    assert "model.hf: model.hf needs transformers, which is not installed: pip install 'shoal[hf]'" in line
