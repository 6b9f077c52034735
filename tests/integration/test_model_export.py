"""`shoal.run` of a quickstart-like workload ends with a registered MLflow model that gives the
same logits as the run's last checkpoint, read independently of shoal's consolidation."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import torch

import shoal
from shoal.models.cnn import ConvNet
from tests.conftest import quickstart, write_workload
from tests.integration.helpers import full_state


def test_run_registers_a_model_with_the_last_checkpoints_logits(workdir: Path, ray_cluster: str) -> None:
    data = quickstart()
    data["train"].update(max_steps=12, eval_every=None)
    data["checkpoint"].update(every_steps=6)
    data["tracking"] = {"experiment": "export", "register": {"name": "digits", "alias": "prod"}}
    path = write_workload(workdir, data)
    result = shoal.run(path, address=ray_cluster, run_name="reg")
    assert result.ok, result.reason
    assert result.model_uri == "models:/digits@prod" and result.model_error is None

    last = workdir / "shoal_runs" / "reg" / "checkpoint-00000012"
    expected = ConvNet(channels=32)
    expected.load_state_dict(full_state(last, workdir)["model"])
    expected.eval()
    val_files = shoal.load_workload(path, prepare_data=True).data.val
    rows = pq.read_table(val_files[0])
    x = torch.tensor(rows.column("x").to_pylist()[:5], dtype=torch.float32)
    mlflow.set_tracking_uri(result.tracking_uri)
    served = mlflow.pytorch.load_model("models:/digits@prod")
    with torch.no_grad():
        assert torch.allclose(served(x), expected(x), atol=1e-5)
        assert torch.allclose(served(x[:1]), expected(x[:1]), atol=1e-5)  # any batch size
