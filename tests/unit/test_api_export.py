"""The Python API in-process (no Ray): a workload loaded from a dict, and `shoal.export` /
`shoal export` of a recorded run's checkpoint in both formats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import shoal
from shoal.cli import main
from shoal.errors import ShoalError
from shoal.models import build_model
from shoal.spec.loader import SpecError
from shoal.tracking.mlflow_run import open_run
from shoal.worker.checkpoint import format as checkpoint_format

GPT = {
    "name": "tiny-gpt",
    "model": {
        "family": "gpt",
        "args": {"vocab_size": 64, "seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2},
    },
    "data": {"builtin": "pytext"},
    "train": {"max_steps": 2},
}


def test_load_workload_takes_a_dict_with_overrides() -> None:
    loaded = shoal.load_workload(GPT, ["train.optimizer.lr=0.01"])
    assert loaded.workload.train.optimizer.lr == 0.01 and loaded.workload.model.family == "gpt"
    with pytest.raises(SpecError, match=r"--set train.max_steps=-1 train.max_steps: must be > 0"):
        shoal.load_workload(GPT, ["train.max_steps=-1"])


def _checkpoint(run_dir: Path, step: int, seed: int) -> dict[str, torch.Tensor]:
    """A 1-rank checkpoint of the workload's model with weights drawn from `seed`."""
    torch.manual_seed(seed)
    model = build_model(shoal.load_workload(GPT).workload.model.model_dump())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    directory = run_dir / checkpoint_format.checkpoint_name(step)
    directory.mkdir(parents=True)
    checkpoint_format.save(directory, [model], [optimizer], 0, {"world_size": 1})
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[int, dict]]:
    """An MLflow run recorded as `shoal run` records it, with checkpoints at steps 1 and 2."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "shoal_runs" / "tiny"
    weights = {1: _checkpoint(run_dir, 1, seed=1), 2: _checkpoint(run_dir, 2, seed=2)}
    resolved = shoal.load_workload(GPT).workload.resolved()
    open_run(uri, "tiny", "tiny", str(run_dir), False, resolved, yaml.safe_dump(resolved), {})
    return uri, weights


def test_export_torch_rebuilds_the_model_of_any_step(recorded: tuple, tmp_path: Path) -> None:
    uri, weights = recorded
    for step, expected in ((None, weights[2]), (1, weights[1])):
        target = tmp_path / f"export-{step}"
        done = shoal.export("tiny", target, "torch", step=step, tracking_uri=uri)
        assert done.step == (step or 2) and {"model.pt", "workload.yaml", "export.json"} <= set(done.files)
        assert json.loads((target / "export.json").read_text())["step"] == done.step
        model = shoal.load_export(target)
        for name, tensor in expected.items():
            assert torch.equal(model.state_dict()[name], tensor), (step, name)


def test_shoal_export_command(recorded: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    uri = recorded[0]
    assert main(["export", "tiny", str(tmp_path / "out"), "--tracking-uri", uri]) == 0
    assert "exported tiny step 2 (torch)" in capsys.readouterr().out
    assert main(["export", "tiny", str(tmp_path / "hf"), "--format", "hf", "--tracking-uri", uri]) == 2
    assert "--format hf needs a Hugging Face model (model.hf)" in capsys.readouterr().err
    assert main(["export", "tiny", str(tmp_path / "x"), "--step", "7", "--tracking-uri", uri]) == 2
    assert "no checkpoint at step 7" in capsys.readouterr().err
    assert main(["export", "nope", str(tmp_path / "x"), "--tracking-uri", uri]) == 2
    assert "no run with id or name 'nope'" in capsys.readouterr().err


def test_load_export_refuses_a_folder_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ShoalError, match="is not a torch export"):
        shoal.load_export(tmp_path)


def test_import_shoal_stays_light_until_the_api_is_used() -> None:
    script = (
        "import sys, shoal; heavy = ('torch', 'ray', 'mlflow');"
        "print(sorted(m for m in heavy if m in sys.modules));"
        "shoal.load_workload; print('shoal.api' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["[]", "True", "False"]  # the API loads its layers when called
    with pytest.raises(AttributeError, match="no attribute 'train'"):
        shoal.train  # noqa: B018 (the attribute access is the test)


def test_sweep_refuses_what_it_cannot_run_before_starting_anything() -> None:
    with pytest.raises(ShoalError, match="no 'sweep' section"):
        shoal.sweep(GPT)
    swept = {
        **GPT,
        "sweep": {"space": {"train.optimizer.lr": {"choice": [0.1, 0.01]}}, "metric": "train/loss"},
    }
    with pytest.raises(ShoalError, match="not one loaded from a dict"):
        shoal.sweep(shoal.load_workload(swept))
