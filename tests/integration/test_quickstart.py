"""The quickstart workload, as shipped, on the shared Ray cluster."""

from __future__ import annotations

from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import quickstart
from tests.integration.conftest import run_workload


def test_quickstart_reaches_target_and_is_fully_tracked(workdir: Path) -> None:
    result = run_workload(workdir, quickstart(), run_name="qs")
    assert result.ok, result.reason
    assert result.step == 400 and result.total_steps == 400
    assert result.metrics["val/accuracy"] >= 0.95

    client = MlflowClient(result.tracking_uri)
    stored = client.get_run(result.run_id)
    assert stored.info.status == "FINISHED" and stored.info.run_name == "qs"
    params = stored.data.params
    assert params["train.optimizer.lr"] == "0.003" and params["scaling.workers"] == "2"
    assert params["model.family"] == "cnn" and len(params) >= 40
    loss_steps = [m.step for m in client.get_metric_history(result.run_id, "train/loss")]
    assert sorted(loss_steps) == list(range(1, 401))  # one point per step, none twice
    for key in ("train/lr", "train/samples_per_s", "train/grad_norm"):
        assert len(client.get_metric_history(result.run_id, key)) == 400
    accuracy = client.get_metric_history(result.run_id, "val/accuracy")
    assert sorted(m.step for m in accuracy) == list(range(50, 401, 50))
    assert max(m.step for m in accuracy) == 400 and accuracy[-1].value >= 0.95
    tags = stored.data.tags
    assert tags["shoal.world_size"] == "2" and tags["shoal.workload"] == "quickstart"
    assert tags["shoal.torch_version"].startswith("2.13") and tags["shoal.ray_version"] == "2.60.0"
    artifact = client.download_artifacts(result.run_id, "workload.yaml", str(workdir))
    assert yaml.safe_load(Path(artifact).read_text())["train"]["max_steps"] == 400

    checkpoints = sorted(p.name for p in (workdir / "shoal_runs" / "qs").glob("checkpoint-*"))
    assert checkpoints == [
        "checkpoint-00000200",
        "checkpoint-00000300",
        "checkpoint-00000400",
    ]  # keep: 3
    assert result.checkpoint.endswith("checkpoint-00000400")
