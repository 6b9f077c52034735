"""The GPU side of monitoring and planning, checked where a CUDA GPU exists: NVML readings,
CUDA peak memory, MFU's catalog entry, and the planner's estimate against the measured peak."""

from __future__ import annotations

import pytest
import torch

from shoal.plan.catalog import gpu_for_device
from shoal.plan.memory import Layout, estimate
from shoal.plan.planner import model_cost, training_of
from shoal.spec.schema import Workload
from shoal.worker.engine import Engine
from shoal.worker.metrics import GpuReadings, peak_memory_mb

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU here: NVML readings, CUDA peak memory, MFU and GPU plan accuracy need one",
)


def test_nvml_readings_and_cuda_peak_memory() -> None:
    device = torch.device("cuda", 0)
    readings = GpuReadings(device)
    assert readings.available
    values = readings.read()
    assert set(values) == set(GpuReadings.FIELDS)
    assert 0 <= values["utilization_pct"] <= 100 and values["memory_used_mb"] > 0
    torch.ones(2**20, device=device)
    assert peak_memory_mb(device) >= 4
    assert gpu_for_device(torch.cuda.get_device_name(0)) is not None, torch.cuda.get_device_name(0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_estimate_within_25_percent_on_gpu(precision: str) -> None:
    model = {"family": "gpt", "args": {"n_layers": 8, "d_model": 512, "n_heads": 8, "seq_len": 512}}
    w = Workload.model_validate(
        {
            "name": "gpu",
            "model": model,
            "data": {"builtin": "pytext", "batch_size": 16},
            "train": {"max_steps": 10, "precision": precision},
        }
    )
    device = torch.device("cuda", 0)
    engine = Engine(w, "lm", 1, device, total_steps=10, accumulation=1)
    batch = {"tokens": torch.randint(0, 256, (16, 513), device=device)}
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(3):
        engine.forward_backward([batch])
        engine.optimizer_step()
    measured = torch.cuda.max_memory_allocated(device)  # only this engine's tensors live on the GPU
    predicted = estimate(model_cost(w, precision), Layout("ddp"), training_of(w), 16).peak
    print(f"{precision}: estimate {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert 0.75 * measured <= predicted <= 1.25 * measured
