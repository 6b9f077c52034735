"""A user's Hugging Face model through `shoal run`, with no wrapper code: a Llama built from
its config trains with FSDP on 2 workers, its loss falls, and a second run resumes it."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.integration.conftest import run_workload
from tests.integration.helpers import full_state

STEPS, MORE_STEPS = 20, 24


def tiny_llama() -> dict:
    config = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {
        "name": "hf_llama",
        "model": {"hf": {"class": "LlamaForCausalLM", "config": config}},
        "data": {"builtin": "pytext", "batch_size": 8, "seq_len": 32},
        "train": {
            "max_steps": STEPS,
            "activation_checkpointing": "full",
            "optimizer": {"lr": 0.02},
        },
        "parallel": {"strategy": "fsdp"},
        "scaling": {"workers": 2},
        "checkpoint": {"every_steps": 10},
    }


def test_hf_llama_trains_with_fsdp_and_resumes(workdir: Path) -> None:
    first = run_workload(workdir, tiny_llama(), run_name="llama")
    assert first.ok, first.reason
    client = MlflowClient(first.tracking_uri)
    losses = [
        m.value for m in sorted(client.get_metric_history(first.run_id, "train/loss"), key=lambda m: m.step)
    ]
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # from ~ln(256) = 5.5 downwards
    state = full_state(workdir / "shoal_runs" / "llama" / f"checkpoint-{STEPS:08d}", workdir)["model"]
    assert "model.layers.0.self_attn.q_proj.weight" in state  # HF's names, through FSDP and AC

    resumed = run_workload(workdir, tiny_llama(), [f"train.max_steps={MORE_STEPS}"], run_name="llama")
    assert resumed.ok, resumed.reason
    assert resumed.run_id == first.run_id
    assert resumed.resumed_from == STEPS and resumed.step == MORE_STEPS
    history = client.get_metric_history(first.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, MORE_STEPS + 1))
