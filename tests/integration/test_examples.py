"""Each folder of examples/ works as its README says, shortened to a few steps.

The example is copied to a temporary directory and run from there, as a user would
run it from the folder, against the session's shared Ray cluster.
"""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from shoal.launch import RunOptions, run
from shoal.spec import load
from tests.conftest import REPO
from tests.integration.helpers import full_state

EXAMPLES = REPO / "examples"


@pytest.fixture
def example(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    """Copy examples/<name> into the test's working directory and work from there."""

    def copy(name: str) -> Path:
        folder = workdir / name
        shutil.copytree(EXAMPLES / name, folder, ignore=shutil.ignore_patterns("data", "__pycache__"))
        monkeypatch.chdir(folder)
        return folder

    return copy


def python(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def history(client: MlflowClient, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_own_loss_example(example) -> None:
    example("own_loss")
    python("make_data.py", "--rows", "1024")
    overrides = ["train.max_steps=60", "train.eval_every=30", "checkpoint.every_steps=60"]
    result = run(load("workload.yaml", overrides, prepare_data=True), RunOptions(run_name="houses"))
    assert result.ok, result.reason
    client = MlflowClient(result.tracking_uri)
    losses = history(client, result.run_id, "train/loss")
    assert len(losses) == 60 and sum(losses[-3:]) < sum(losses[:3]) / 4
    assert len(history(client, result.run_id, "train/mae")) == 60
    assert len(history(client, result.run_id, "val/mae")) == 2


def test_tiny_llama_example(example) -> None:
    """Also the acceptance run of a user's HF model: FSDP on 2 workers, no wrapper code, loss
    falling, HF's parameter names in the checkpoint, and a resume into the same MLflow run."""
    folder = example("tiny_llama")
    python("make_corpus.py", "--documents", "600")
    overrides = ["train.max_steps=12", "checkpoint.every_steps=12", "train.activation_checkpointing=full"]
    result = run(load("workload.yaml", overrides, prepare_data=True), RunOptions(run_name="llama"))
    assert result.ok, result.reason
    client = MlflowClient(result.tracking_uri)
    losses = history(client, result.run_id, "train/loss")
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    run_dir = folder / "shoal_runs" / "llama"
    state = full_state(run_dir / "checkpoint-00000012", folder)["model"]
    assert "model.layers.0.self_attn.q_proj.weight" in state  # HF's names, through FSDP and AC
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert "tokenizer/tokenizer.json" in {a.path for a in client.list_artifacts(result.run_id, "tokenizer")}
    assert result.model_uri == "models:/tiny-llama@champion"
    mlflow.set_tracking_uri(result.tracking_uri)
    (generated,) = mlflow.pyfunc.load_model(result.model_uri).predict(["def main():"])
    assert isinstance(generated, str) and generated

    more = [*overrides[1:], "train.max_steps=14", "tracking.log_model=false"]
    resumed = run(load("workload.yaml", more, prepare_data=True), RunOptions(run_name="llama"))
    assert resumed.ok, resumed.reason
    assert resumed.run_id == result.run_id and resumed.resumed_from == 12 and resumed.step == 14
    steps = sorted(m.step for m in client.get_metric_history(result.run_id, "train/loss"))
    assert steps == list(range(1, 15))  # every step once, none replayed into the run


def test_sweep_api_example(example, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    folder = example("sweep_api")
    steps = ["train.max_steps=10", "train.eval_every=5", "checkpoint.every_steps=10"]
    monkeypatch.setattr(sys, "argv", ["sweep_and_load.py", *(f"--set={s}" for s in steps)])
    runpy.run_path(str(folder / "sweep_and_load.py"), run_name="__main__")
    out = capsys.readouterr().out
    best = re.search(r"best trial \S+: .*, val/accuracy ([0-9.]+)", out)
    loaded = re.search(r"models:/digits-mlp@best: accuracy ([0-9.]+) on (\d+) held-out digits", out)
    assert best and loaded, out
    assert abs(float(best.group(1)) - float(loaded.group(1))) < 0.01  # the same model, the same digits
