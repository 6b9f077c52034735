"""FSDP and tensor x pipeline parallel through `shoal run` on Ray Train.

The hybrid job trains a few steps, stops; the same run name then resumes from the
sharded checkpoint (DCP) and finishes: loss falls, steps continue, one MLflow run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import WORKLOADS
from tests.integration.conftest import run_workload

SMALL = [
    "model.args.d_model=64",
    "model.args.seq_len=64",
    "train.eval_every=null",
    "checkpoint.every_steps=8",
]


@pytest.mark.parametrize(("name", "resume"), [("gpt_fsdp", False), ("gpt_hybrid", True)])
def test_parallel_workload_trains_and_resumes(name: str, resume: bool, workdir: Path) -> None:
    """FSDP resumes (bitwise, async) in test_recovery.py; here the TP x PP layout resumes."""
    data = yaml.safe_load((WORKLOADS / f"{name}.yaml").read_text())
    last = [*SMALL, "train.max_steps=16", "train.eval_every=16"]
    if resume:
        first = run_workload(workdir, data, [*SMALL, "train.max_steps=8"], run_name=name)
        assert first.ok, first.reason
    second = run_workload(workdir, data, last, run_name=name)
    assert second.ok, second.reason
    assert second.step == 16
    if resume:
        assert second.run_id == first.run_id and second.resumed_from == 8

    client = MlflowClient(second.tracking_uri)
    losses = client.get_metric_history(second.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 17))
    by_step = {m.step: m.value for m in losses}
    assert by_step[16] < by_step[1] - 0.5  # from ~5.5 nats/byte, falling
    assert "val/loss" in second.metrics
    tags = client.get_run(second.run_id).data.tags
    assert tags["shoal.world_size"] == str(data["scaling"]["workers"])
