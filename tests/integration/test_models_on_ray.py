"""The other task and model paths on Ray: a byte GPT on pytext, a user's own model, and one
with its own loss on its own columns."""

from __future__ import annotations

import math
from pathlib import Path

from mlflow.tracking import MlflowClient

from shoal.data import prepare
from tests.integration.conftest import run_workload


def test_tiny_gpt_on_pytext_learns(workdir: Path) -> None:
    data = {
        "name": "tiny_gpt",
        "model": {
            "family": "gpt",
            "args": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32},
        },
        "data": {"builtin": "pytext", "batch_size": 8},
        "train": {
            "max_steps": 40,
            "precision": "bf16",
            "eval_every": 40,
            "eval_batches": 4,
            "optimizer": {"lr": 0.01},
        },
        "scaling": {"workers": 2},
    }
    result = run_workload(workdir, data, run_name="gpt")
    assert result.ok, result.reason
    assert result.metrics["val/loss"] < math.log(256) - 1.0  # well below uniform over bytes
    client = MlflowClient(result.tracking_uri)
    tokens = client.get_metric_history(result.run_id, "train/tokens_per_s")
    assert len(tokens) == 40 and all(m.value > 0 for m in tokens)


def test_user_model_from_the_working_directory(workdir: Path) -> None:
    (workdir / "my_net.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    task = 'classify'\n"
        "    def __init__(self, hidden=32):\n"
        "        super().__init__()\n"
        "        self.body = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),\n"
        "                                        torch.nn.Linear(hidden, 10))\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
    )
    prepare("digits", workdir / "mydata")  # stands in for the user's own parquet shards
    data = {
        "name": "custom",
        "model": {"target": "my_net:Net", "args": {"hidden": 32}},
        "data": {
            "train": {"path": "mydata/train/part-*.parquet"},
            "val": {"path": "mydata/val"},
            "batch_size": 32,
        },
        "train": {"max_steps": 60, "eval_every": 60, "optimizer": {"lr": 0.01}},
        "scaling": {"workers": 1},
    }
    result = run_workload(workdir, data, run_name="custom")
    assert result.ok, result.reason
    assert result.metrics["val/accuracy"] > 0.8


def test_non_finite_loss_fails_the_job_without_restarts(workdir: Path) -> None:
    (workdir / "nan_net.py").write_text(
        "import torch\n"
        "class NanNet(torch.nn.Module):\n"
        "    task = 'classify'\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x) * float('nan')\n"
    )
    data = {
        "name": "nan",
        "model": {"target": "nan_net:NanNet"},
        "data": {"builtin": "digits", "batch_size": 32},
        "train": {"max_steps": 20},
        "scaling": {"workers": 2},
        "failure": {"max_restarts": 2},
    }
    result = run_workload(workdir, data, run_name="nan")
    assert result.status == "FAILED"
    assert result.reason == "training loss is nan at step 1 (failure.on_nan: fail)"
    assert result.restarts == 0
    assert MlflowClient(result.tracking_uri).get_run(result.run_id).info.status == "FAILED"
